//! Container logs as `kubectl logs` reads them: the options of a log request
//! (the query of `pods/{name}/log` and of the kubelet's
//! `/containerLogs/{namespace}/{pod}/{container}`, which kube-apiserver
//! forwards), and the response body read from a container's log file.
//!
//! A container's stdout and stderr go, unchanged and interleaved, to one
//! plain file per instance (`logs/<container>/<restart>.log` in the pod's
//! directory). There is no per-line time and no separation of the two
//! streams, so `timestamps`, `sinceSeconds`, `sinceTime` and a `stream`
//! other than `All` are refused ([`QueryError::Unsupported`]) rather than
//! answered wrongly.
//!
//! Both the simulator's `pods/{name}/log` and the node agent's kubelet API
//! ([`super::api`]) serve logs through [`body`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio::io::AsyncReadExt as _;
use tokio_util::sync::CancellationToken;

/// How often a followed log is checked for new output.
pub const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// What a log request asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogOptions {
    /// Keep streaming what the container writes until it ends.
    pub follow: bool,
    /// The instance before the current one.
    pub previous: bool,
    /// Only the last this many lines of what is there (new output follows in full).
    pub tail_lines: Option<u64>,
    /// At most this many bytes in all.
    pub limit_bytes: Option<u64>,
}

/// Why a log request's query cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("{param}={value:?}: {expected}")]
    Invalid {
        param: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("{param} is not supported by this node agent: {why}")]
    Unsupported { param: &'static str, why: &'static str },
}

/// A boolean query parameter as Go's `strconv.ParseBool` reads it (what
/// kube-apiserver's parameter codec accepts).
fn parse_bool(q: &HashMap<String, String>, param: &'static str) -> Result<bool, QueryError> {
    match q.get(param).map(String::as_str) {
        None | Some("") => Ok(false),
        Some("1" | "t" | "T" | "true" | "TRUE" | "True") => Ok(true),
        Some("0" | "f" | "F" | "false" | "FALSE" | "False") => Ok(false),
        Some(other) => Err(QueryError::Invalid {
            param,
            value: other.to_owned(),
            expected: "a boolean",
        }),
    }
}

fn parse_count(
    q: &HashMap<String, String>,
    param: &'static str,
    min: u64,
    expected: &'static str,
) -> Result<Option<u64>, QueryError> {
    let Some(value) = q.get(param).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match value.parse::<u64>() {
        Ok(n) if n >= min => Ok(Some(n)),
        _ => Err(QueryError::Invalid {
            param,
            value: value.clone(),
            expected,
        }),
    }
}

impl LogOptions {
    /// The options of a query (`follow`, `previous`, `tailLines` or the
    /// older `tail`, `limitBytes`); refuses what the log files cannot answer.
    ///
    /// # Errors
    /// [`QueryError`]: a malformed value, or `timestamps=true`,
    /// `sinceSeconds`, `sinceTime`, or a `stream` other than `All`.
    pub fn from_query(q: &HashMap<String, String>) -> Result<Self, QueryError> {
        if parse_bool(q, "timestamps")? {
            return Err(QueryError::Unsupported {
                param: "timestamps",
                why: "container output is kept without the time of each line",
            });
        }
        for param in ["sinceSeconds", "sinceTime"] {
            if q.get(param).is_some_and(|v| !v.is_empty()) {
                return Err(QueryError::Unsupported {
                    param,
                    why: "container output is kept without the time of each line",
                });
            }
        }
        if q.get("stream").is_some_and(|s| !s.is_empty() && s != "All") {
            return Err(QueryError::Unsupported {
                param: "stream",
                why: "stdout and stderr go to one file; only All is served",
            });
        }
        let tail_lines = match q.get("tail").map(String::as_str) {
            // The kubelet's older spelling; `all` is the whole log.
            Some("all") => None,
            Some(_) if !q.contains_key("tailLines") => {
                parse_count(q, "tail", 0, "a number of lines, 0 or more")?
            }
            _ => parse_count(q, "tailLines", 0, "a number of lines, 0 or more")?,
        };
        Ok(Self {
            follow: parse_bool(q, "follow")?,
            previous: parse_bool(q, "previous")?,
            tail_lines,
            limit_bytes: parse_count(q, "limitBytes", 1, "a number of bytes, 1 or more")?,
        })
    }
}

/// Where the last `lines` lines of `data` start. A line ends at `\n`; an
/// unterminated end of the data is a line too.
#[must_use]
pub fn tail_start(data: &[u8], lines: u64) -> usize {
    if lines == 0 {
        return data.len();
    }
    let end = data.len() - usize::from(data.last() == Some(&b'\n'));
    let mut seen = 0;
    for (i, b) in data[..end].iter().enumerate().rev() {
        if *b == b'\n' {
            seen += 1;
            if seen == lines {
                return i + 1;
            }
        }
    }
    0
}

/// Why a log file could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading {path}: {source}")]
pub struct ReadError {
    path: PathBuf,
    source: std::io::Error,
}

/// An instance's log file, open for [`body`].
#[derive(Debug)]
pub struct LogFile {
    path: PathBuf,
    file: std::fs::File,
}

impl LogFile {
    /// Opens the log file at `path`.
    ///
    /// # Errors
    /// [`ReadError`] when it cannot be opened.
    pub fn open(path: PathBuf) -> Result<Self, ReadError> {
        match std::fs::File::open(&path) {
            Ok(file) => Ok(Self { path, file }),
            Err(source) => Err(ReadError { path, source }),
        }
    }
}

/// The answer to a log request for the instance logged in `log`: what the
/// file holds now (its tail, with `tail_lines`), then, with `follow`, what
/// is appended, checked every [`FOLLOW_POLL`] until `running` answers false
/// (the instance ended: what it wrote last is sent, then the stream ends),
/// `stop` fires, or the consumer drops the stream (the client went away).
/// At most `limit_bytes` in all.
///
/// What the file holds now is read before this returns (as the simulator's
/// request handling is synchronous; container logs are small).
///
/// # Errors
/// [`ReadError`] when the file cannot be read now; a later failure ends the
/// stream with it.
pub fn body<F>(
    log: LogFile,
    options: &LogOptions,
    running: F,
    stop: CancellationToken,
) -> Result<impl Stream<Item = Result<Bytes, ReadError>> + Send + 'static + use<F>, ReadError>
where
    F: FnMut() -> bool + Send + 'static,
{
    use std::io::Read as _;
    let LogFile { path, mut file } = log;
    let mut now = Vec::new();
    if let Err(source) = file.read_to_end(&mut now) {
        return Err(ReadError { path, source });
    }
    if let Some(lines) = options.tail_lines {
        now.drain(..tail_start(&now, lines));
    }
    let state = Follow {
        file: tokio::fs::File::from_std(file),
        path,
        first: Some(now),
        left: options.limit_bytes,
        running,
        stop,
        done: !options.follow,
    };
    Ok(futures::stream::unfold(state, |mut state| async move {
        let item = state.next().await?;
        Some((item, state))
    }))
}

/// The state of a log response.
struct Follow<F> {
    path: PathBuf,
    file: tokio::fs::File,
    /// What the file held when the request came, not sent yet.
    first: Option<Vec<u8>>,
    /// What is left of the byte limit.
    left: Option<u64>,
    running: F,
    stop: CancellationToken,
    /// Nothing more is sent (after `first`).
    done: bool,
}

impl<F: FnMut() -> bool> Follow<F> {
    /// What was appended since the last read.
    async fn read_more(&mut self) -> Result<Vec<u8>, ReadError> {
        let mut buf = Vec::new();
        match self.file.read_to_end(&mut buf).await {
            Ok(_) => Ok(buf),
            Err(source) => Err(ReadError {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// `data` within what is left of the byte limit; the end once it is reached.
    fn limited(&mut self, mut data: Vec<u8>) -> Vec<u8> {
        if let Some(left) = self.left.as_mut() {
            let keep = usize::try_from(*left).unwrap_or(usize::MAX).min(data.len());
            data.truncate(keep);
            *left -= u64::try_from(keep).unwrap_or(*left);
            if *left == 0 {
                self.done = true;
            }
        }
        data
    }

    async fn next(&mut self) -> Option<Result<Bytes, ReadError>> {
        if let Some(first) = self.first.take() {
            let data = self.limited(first);
            if !data.is_empty() {
                return Some(Ok(Bytes::from(data)));
            }
        }
        if self.done {
            return None;
        }
        loop {
            let ended = !(self.running)();
            let data = match self.read_more().await {
                Ok(d) => d,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            };
            if ended {
                // What the instance wrote before it ended, then the end.
                self.done = true;
            }
            if !data.is_empty() {
                return Some(Ok(Bytes::from(self.limited(data))));
            }
            if self.done {
                return None;
            }
            tokio::select! {
                () = tokio::time::sleep(FOLLOW_POLL) => {}
                () = self.stop.cancelled() => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt as _;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_query_kube_apiserver_forwards_is_read() {
        assert_eq!(
            LogOptions::from_query(&query(&[])).unwrap(),
            LogOptions::default()
        );
        assert_eq!(
            LogOptions::from_query(&query(&[
                ("follow", "true"),
                ("previous", "1"),
                ("tailLines", "3"),
                ("limitBytes", "10"),
                ("stream", "All"),
                ("timestamps", "false"),
            ]))
            .unwrap(),
            LogOptions {
                follow: true,
                previous: true,
                tail_lines: Some(3),
                limit_bytes: Some(10),
            }
        );
        assert_eq!(
            LogOptions::from_query(&query(&[("tail", "2")]))
                .unwrap()
                .tail_lines,
            Some(2),
            "the older spelling"
        );
        assert_eq!(
            LogOptions::from_query(&query(&[("tail", "all")]))
                .unwrap()
                .tail_lines,
            None
        );
        assert_eq!(
            LogOptions::from_query(&query(&[("tail", "2"), ("tailLines", "5")]))
                .unwrap()
                .tail_lines,
            Some(5),
            "tailLines wins"
        );
    }

    #[test]
    fn what_the_log_files_cannot_answer_is_refused_by_name() {
        for (param, value) in [
            ("timestamps", "true"),
            ("sinceSeconds", "10"),
            ("sinceTime", "2026-01-01T00:00:00Z"),
            ("stream", "Stdout"),
        ] {
            let err = LogOptions::from_query(&query(&[(param, value)])).unwrap_err();
            assert!(
                matches!(err, QueryError::Unsupported { param: p, .. } if p == param),
                "{param}: {err}"
            );
            assert!(err.to_string().starts_with(param), "{err}");
        }
        for (param, value) in [
            ("tailLines", "-1"),
            ("tailLines", "x"),
            ("limitBytes", "0"),
            ("follow", "yes"),
        ] {
            let err = LogOptions::from_query(&query(&[(param, value)])).unwrap_err();
            assert!(
                matches!(err, QueryError::Invalid { param: p, .. } if p == param),
                "{param}={value}: {err}"
            );
        }
    }

    #[test]
    fn the_tail_counts_lines_from_the_end_and_an_unterminated_one_too() {
        let data = b"a\nbb\nccc\n";
        assert_eq!(&data[tail_start(data, 1)..], b"ccc\n");
        assert_eq!(&data[tail_start(data, 2)..], b"bb\nccc\n");
        assert_eq!(&data[tail_start(data, 3)..], data);
        assert_eq!(&data[tail_start(data, 10)..], data);
        assert_eq!(&data[tail_start(data, 0)..], b"");
        let open = b"a\nbb\npartial";
        assert_eq!(&open[tail_start(open, 1)..], b"partial");
        assert_eq!(&open[tail_start(open, 2)..], b"bb\npartial");
        assert_eq!(tail_start(b"", 3), 0);
        assert_eq!(tail_start(b"\n\n", 1), 1);
    }

    fn temp_log(name: &str, contents: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "skipper-logs-{}-{name}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("0.log");
        std::fs::write(&path, contents).unwrap();
        path
    }

    async fn collect(s: impl Stream<Item = Result<Bytes, ReadError>>) -> Vec<u8> {
        let chunks: Vec<_> = s.collect().await;
        chunks.into_iter().flat_map(|c| c.unwrap().to_vec()).collect()
    }

    #[tokio::test]
    async fn a_log_is_read_whole_by_its_tail_or_up_to_the_byte_limit() {
        let path = temp_log("read", b"one\ntwo\nthree\n");
        let open = || LogFile::open(path.clone()).unwrap();
        let read = async |options: LogOptions| {
            let stream = body(open(), &options, || true, CancellationToken::new());
            collect(stream.unwrap()).await
        };
        assert_eq!(read(LogOptions::default()).await, b"one\ntwo\nthree\n");
        let tail = LogOptions {
            tail_lines: Some(2),
            ..LogOptions::default()
        };
        assert_eq!(read(tail).await, b"two\nthree\n");
        let limit = LogOptions {
            tail_lines: Some(2),
            limit_bytes: Some(6),
            ..LogOptions::default()
        };
        assert_eq!(read(limit).await, b"two\nth", "the limit applies to the tail");
        let missing = LogFile::open(path.with_file_name("9.log")).unwrap_err();
        assert!(missing.to_string().contains("9.log"), "{missing}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[tokio::test]
    async fn a_followed_log_streams_what_is_appended_until_the_instance_ends() {
        let path = temp_log("follow", b"old\nolder\n");
        let running = Arc::new(AtomicBool::new(true));
        let alive = running.clone();
        let options = LogOptions {
            follow: true,
            tail_lines: Some(1),
            ..LogOptions::default()
        };
        let mut stream = Box::pin(
            body(
                LogFile::open(path.clone()).unwrap(),
                &options,
                move || alive.load(Ordering::SeqCst),
                CancellationToken::new(),
            )
            .unwrap(),
        );
        let append = |text: &str| {
            use std::io::Write as _;
            let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
            f.write_all(text.as_bytes()).unwrap();
        };
        let next = async |s: &mut std::pin::Pin<Box<_>>| {
            tokio::time::timeout(Duration::from_secs(10), futures::StreamExt::next(s))
                .await
                .expect("a chunk or the end within 10 s")
        };
        let first: Option<Result<Bytes, ReadError>> = next(&mut stream).await;
        assert_eq!(first.unwrap().unwrap(), "older\n", "the tail of what was there");
        append("later\n");
        assert_eq!(next(&mut stream).await.unwrap().unwrap(), "later\n");
        // The instance writes its last line and ends before the next check.
        append("last\n");
        running.store(false, Ordering::SeqCst);
        assert_eq!(next(&mut stream).await.unwrap().unwrap(), "last\n");
        assert!(
            next(&mut stream).await.is_none(),
            "the stream ends with the instance"
        );
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[tokio::test]
    async fn a_followed_log_ends_when_stopped_or_at_the_byte_limit() {
        let path = temp_log("stop", b"0123456789\n");
        let stop = CancellationToken::new();
        let options = LogOptions {
            follow: true,
            ..LogOptions::default()
        };
        let mut stream = Box::pin(
            body(
                LogFile::open(path.clone()).unwrap(),
                &options,
                || true,
                stop.clone(),
            )
            .unwrap(),
        );
        assert_eq!(
            futures::StreamExt::next(&mut stream).await.unwrap().unwrap(),
            "0123456789\n"
        );
        stop.cancel();
        let end = tokio::time::timeout(Duration::from_secs(10), futures::StreamExt::next(&mut stream)).await;
        assert!(matches!(end, Ok(None)), "stopped: {end:?}");

        let limited = LogOptions {
            follow: true,
            limit_bytes: Some(4),
            ..LogOptions::default()
        };
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            let stream = body(
                LogFile::open(path.clone()).unwrap(),
                &limited,
                || true,
                CancellationToken::new(),
            );
            collect(stream.unwrap()).await
        })
        .await
        .expect("the limit ends a followed log");
        assert_eq!(got, b"0123");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
