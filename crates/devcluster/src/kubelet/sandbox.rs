//! Container sandboxes: the hidden `skipper __sandbox` subcommand, a small
//! shim like a container runtime's. `main.rs` dispatches to [`main`] before
//! any thread exists, because `unshare` and `setns` of mount namespaces
//! need a single-threaded process.
//!
//! `__sandbox run` reads a [`RunSpec`] on stdin and:
//! 1. asks to be killed with its parent (the node agent), opens the log,
//!    and joins the pod's network namespace when it has one;
//! 2. unshares mount, PID and UTS namespaces (and a user namespace mapping
//!    the caller to root when it is not root), makes every mount private and
//!    sets the pod's hostname;
//! 3. bind-mounts each [`MountSpec`] — the container's private `/tmp` and
//!    home, its volumes, `/etc/hosts` — creating missing mount points
//!    *inside the namespace only*: the nearest existing ancestor is covered
//!    by a tmpfs that mirrors its entries (each bound back from the original,
//!    submounts included), or, for a new top-level directory, the root moves
//!    to such a tmpfs with `pivot_root`; nothing is created on the host;
//! 4. starts `__sandbox init` as PID 1 of the new PID namespace: it asks to
//!    be killed with the shim, mounts a `/proc` of its namespace and `exec`s
//!    the container's command, which thereby becomes PID 1 — signals reach
//!    only it, and every other process of the container dies with it;
//! 5. prints the host pid of that process (a [`Control`] line) and exits
//!    with its exit status (128 + signal number when killed by a signal).
//!
//! `__sandbox exec --target PID` joins the namespaces of a container's main
//! process and runs a command there (exec probes, `preStop` exec hooks, like
//! `nsenter` or `kubectl exec`); `__sandbox check` tells whether this process
//! can create the namespaces at all ([`check`]).

use std::ffi::{CString, OsStr, OsString};
use std::io::{Read as _, Write as _};
use std::os::fd::{AsFd, AsRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::signal::Signal;
use nix::sys::stat::{Mode, SFlag};
use serde::{Deserialize, Serialize};

/// The hidden subcommand (`skipper __sandbox ...`).
pub const SUBCOMMAND: &str = "__sandbox";

/// The `PATH` a container gets when its environment sets none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// One bind mount into the container.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MountSpec {
    /// The host path (a directory or a file).
    pub source: PathBuf,
    /// Where the container sees it.
    pub target: PathBuf,
    pub read_only: bool,
}

/// What `__sandbox run` sets up and runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSpec {
    /// The pid of the node agent (the shim stops when it is gone).
    pub parent: u32,
    /// The hostname of the pod.
    pub hostname: String,
    /// Bind mounts, parents before children.
    pub mounts: Vec<MountSpec>,
    /// An empty host directory the shim may mount on (to build a new root).
    pub stage: PathBuf,
    /// The command as the pod names it (`argv[0]` first).
    pub argv: Vec<String>,
    /// A host binary to run instead of resolving `argv[0]` (the binary an
    /// image provides; reachable even when the sandbox hides its directory).
    pub exe: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    /// `workingDir` (`/` when unset).
    pub cwd: Option<PathBuf>,
    /// Where the container's stdout and stderr go.
    pub log: PathBuf,
    /// The pod's network namespace (a pinned path, `/run/netns/<name>`),
    /// joined before the other namespaces are made; the host's when `None`.
    #[serde(default)]
    pub netns: Option<PathBuf>,
}

/// The line `__sandbox run` prints once the container started (or failed to).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Control {
    /// The host pid of the container's main process.
    Started { pid: u32 },
    /// Why the container could not start (the shim exits 128).
    Failed { message: String },
}

/// A step of sandbox setup that failed.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("{step}: {errno}")]
    Sys { step: String, errno: Errno },
    #[error("{step}: {source}")]
    Io { step: String, source: std::io::Error },
    #[error("exec: {0:?}: executable file not found in $PATH")]
    NotFound(String),
    #[error("the node agent is gone")]
    ParentGone,
    #[error("{0}")]
    Invalid(String),
}

fn sys(step: impl FnOnce() -> String) -> impl FnOnce(Errno) -> SandboxError {
    move |errno| SandboxError::Sys { step: step(), errno }
}

fn io(step: impl FnOnce() -> String) -> impl FnOnce(std::io::Error) -> SandboxError {
    move |source| SandboxError::Io { step: step(), source }
}

/// Entry point of `skipper __sandbox <run|init|exec|check> ...` (`args`
/// start after `__sandbox`). Runs before any other thread exists.
#[must_use]
pub fn main(args: &[OsString]) -> ExitCode {
    let (cmd, rest) = match args.split_first() {
        Some((c, rest)) => (c.to_string_lossy().into_owned(), rest),
        None => (String::new(), &[][..]),
    };
    match cmd.as_str() {
        "run" => run(),
        "init" => init(rest),
        "exec" => exec(rest),
        "exec-child" => exec_child(rest),
        "check" => match check_here() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("{e}");
                ExitCode::FAILURE
            }
        },
        other => {
            eprintln!("skipper {SUBCOMMAND}: unknown command {other:?} (run, init, exec, exec-child, check)");
            ExitCode::from(2)
        }
    }
}

fn report(control: &Control) {
    let mut out = std::io::stdout().lock();
    if let Ok(line) = serde_json::to_string(control) {
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(128);
    ExitCode::from(u8::try_from(code & 0xff).unwrap_or(128))
}

fn run() -> ExitCode {
    let mut input = String::new();
    let spec = std::io::stdin()
        .read_to_string(&mut input)
        .map_err(io(|| "reading the sandbox spec".into()))
        .and_then(|_| {
            serde_json::from_str::<RunSpec>(&input)
                .map_err(|e| SandboxError::Invalid(format!("the sandbox spec is not valid: {e}")))
        });
    let started = spec.and_then(|spec| start(&spec));
    match started {
        // The image binary stays open until the container ends: PID 1
        // reopens it through this process.
        Ok((mut child, _exe)) => {
            report(&Control::Started { pid: child.id() });
            match child.wait() {
                Ok(status) => exit_code(status),
                Err(_) => ExitCode::from(128),
            }
        }
        Err(e) => {
            report(&Control::Failed {
                message: e.to_string(),
            });
            ExitCode::from(128)
        }
    }
}

/// The namespaces a sandbox gets; a user namespace too when not root.
fn namespace_flags() -> CloneFlags {
    let mut flags = CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWUTS;
    if !nix::unistd::geteuid().is_root() {
        flags |= CloneFlags::CLONE_NEWUSER;
    }
    flags
}

/// Unshares the sandbox namespaces and makes every mount private.
fn enter_namespaces() -> Result<(), SandboxError> {
    let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());
    let flags = namespace_flags();
    nix::sched::unshare(flags).map_err(sys(|| "unshare(CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWUTS)".into()))?;
    if flags.contains(CloneFlags::CLONE_NEWUSER) {
        // Map the caller to root inside, so mounts are permitted.
        std::fs::write("/proc/self/setgroups", "deny")
            .map_err(io(|| "writing /proc/self/setgroups".into()))?;
        std::fs::write("/proc/self/uid_map", format!("0 {uid} 1"))
            .map_err(io(|| "writing /proc/self/uid_map".into()))?;
        std::fs::write("/proc/self/gid_map", format!("0 {gid} 1"))
            .map_err(io(|| "writing /proc/self/gid_map".into()))?;
    }
    nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(sys(|| "making mounts private".into()))
}

fn open_path(p: &Path) -> Result<OwnedFd, SandboxError> {
    nix::fcntl::open(p, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(sys(|| format!("opening {}", p.display())))
}

fn fd_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

fn is_dir_fd(fd: &OwnedFd) -> Result<bool, SandboxError> {
    let st = nix::sys::stat::fstat(fd.as_fd()).map_err(sys(|| "stat of a mount source".into()))?;
    Ok(SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR)
}

/// The longest prefix of `path` that exists (symlinks resolved) and the
/// components below it that do not.
fn split_existing(path: &Path) -> (PathBuf, Vec<OsString>) {
    let mut missing = Vec::new();
    let mut cur = path.to_path_buf();
    loop {
        if let Ok(real) = std::fs::canonicalize(&cur) {
            missing.reverse();
            return (real, missing);
        }
        match (cur.file_name().map(OsStr::to_os_string), cur.parent()) {
            (Some(name), Some(parent)) => {
                missing.push(name);
                cur = parent.to_path_buf();
            }
            _ => {
                missing.reverse();
                return (PathBuf::from("/"), missing);
            }
        }
    }
}

/// Directories whose content belongs to this sandbox.
#[derive(Debug, Default)]
struct Owned {
    /// Covered by a tmpfs of ours: new entries directly inside are private.
    shadows: Vec<PathBuf>,
    /// Mounted by us (volumes, private directories): anything below is ours.
    trees: Vec<PathBuf>,
}

impl Owned {
    fn owns(&self, dir: &Path) -> bool {
        self.shadows.iter().any(|s| s == dir) || self.trees.iter().any(|t| dir.starts_with(t))
    }
}

fn mount_tmpfs(target: &Path, mode: u32) -> Result<(), SandboxError> {
    nix::mount::mount(
        Some("tmpfs"),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(format!("mode={mode:o}").as_str()),
    )
    .map_err(sys(|| format!("mounting a tmpfs on {}", target.display())))
}

fn bind(source: &Path, target: &Path, recursive: bool) -> Result<(), SandboxError> {
    let mut flags = MsFlags::MS_BIND;
    if recursive {
        flags |= MsFlags::MS_REC;
    }
    nix::mount::mount(Some(source), target, None::<&str>, flags, None::<&str>).map_err(sys(|| {
        format!("bind-mounting {} on {}", source.display(), target.display())
    }))
}

/// Fills the tmpfs at `into` with the entries of the directory `from` (an
/// fd of the original): directories and files are bound back (with their
/// submounts), symlinks recreated.
fn mirror(from: &OwnedFd, into: &Path) -> Result<(), SandboxError> {
    let from_path = fd_path(from);
    let entries = std::fs::read_dir(&from_path).map_err(io(|| format!("listing {}", into.display())))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let src = from_path.join(&name);
        let dst = into.join(&name);
        let Ok(meta) = std::fs::symlink_metadata(&src) else {
            continue;
        };
        let ft = meta.file_type();
        if ft.is_symlink() {
            if let Ok(target) = std::fs::read_link(&src) {
                std::os::unix::fs::symlink(target, &dst)
                    .map_err(io(|| format!("linking {}", dst.display())))?;
            }
        } else if ft.is_dir() {
            std::fs::create_dir(&dst).map_err(io(|| format!("creating {}", dst.display())))?;
            bind(&src, &dst, true)?;
        } else {
            std::fs::File::create(&dst).map_err(io(|| format!("creating {}", dst.display())))?;
            bind(&src, &dst, false)?;
        }
    }
    Ok(())
}

fn copy_owner_and_mode(from: &Path, to: &Path) {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    if let Ok(meta) = std::fs::metadata(from) {
        let _ = std::fs::set_permissions(to, std::fs::Permissions::from_mode(meta.mode() & 0o7777));
        let _ = std::os::unix::fs::chown(to, Some(meta.uid()), Some(meta.gid()));
    }
}

/// Covers `dir` with a tmpfs that mirrors it, so new entries stay private.
fn shadow(dir: &Path) -> Result<(), SandboxError> {
    let original = nix::fcntl::open(
        dir,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys(|| format!("opening {}", dir.display())))?;
    mount_tmpfs(dir, 0o755)?;
    copy_owner_and_mode(&fd_path(&original), dir);
    mirror(&original, dir)
}

/// Moves the root to a tmpfs mirroring it (mounted on `stage`); the old root
/// stays reachable at `/.oldroot` until [`drop_old_root`].
fn new_root(stage: &Path) -> Result<(), SandboxError> {
    let root = nix::fcntl::open(
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys(|| "opening /".into()))?;
    mount_tmpfs(stage, 0o755)?;
    mirror(&root, stage)?;
    // The stage itself may have been bound back inside the new root.
    if let Ok(rel) = stage.strip_prefix("/") {
        let _ = nix::mount::umount2(&stage.join(rel), MntFlags::MNT_DETACH);
    }
    let old = stage.join(".oldroot");
    std::fs::create_dir(&old).map_err(io(|| format!("creating {}", old.display())))?;
    nix::unistd::chdir(stage).map_err(sys(|| format!("entering {}", stage.display())))?;
    nix::unistd::pivot_root(".", ".oldroot").map_err(sys(|| "pivot_root".into()))?;
    nix::unistd::chdir("/").map_err(sys(|| "entering /".into()))
}

fn drop_old_root() -> Result<(), SandboxError> {
    nix::mount::umount2("/.oldroot", MntFlags::MNT_DETACH)
        .map_err(sys(|| "detaching the old root".into()))?;
    std::fs::remove_dir("/.oldroot").map_err(io(|| "removing /.oldroot".into()))
}

/// Makes `target` exist inside the sandbox (a directory, or a file when
/// `file`), without touching the host.
fn ensure_target(target: &Path, file: bool, owned: &mut Owned) -> Result<(), SandboxError> {
    let (existing, missing) = split_existing(target);
    if missing.is_empty() {
        return Ok(());
    }
    if !owned.owns(&existing) {
        shadow(&existing)?;
        owned.shadows.push(existing.clone());
    }
    let mut cur = existing;
    let last = missing.len() - 1;
    for (i, name) in missing.iter().enumerate() {
        cur.push(name);
        if i == last && file {
            std::fs::File::create(&cur).map_err(io(|| format!("creating {}", cur.display())))?;
        } else {
            match std::fs::create_dir(&cur) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(SandboxError::Io {
                        step: format!("creating {}", cur.display()),
                        source: e,
                    });
                }
            }
        }
    }
    Ok(())
}

fn normalize(p: &Path) -> Result<PathBuf, SandboxError> {
    if !p.is_absolute() || p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(SandboxError::Invalid(format!(
            "mount path {} must be absolute without '..'",
            p.display()
        )));
    }
    Ok(p.components().collect())
}

/// Finds `program` on `PATH` as seen inside the sandbox.
fn resolve_program(program: &str, path_var: &str) -> Result<PathBuf, SandboxError> {
    use std::os::unix::fs::PermissionsExt as _;
    let executable =
        |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if executable(&p) {
            Ok(p)
        } else {
            Err(SandboxError::Invalid(format!(
                "exec: {program:?}: stat {program}: no such file or directory"
            )))
        };
    }
    path_var
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(program))
        .find(|p| executable(p))
        .ok_or_else(|| SandboxError::NotFound(program.to_owned()))
}

fn start(spec: &RunSpec) -> Result<(std::process::Child, Option<std::fs::File>), SandboxError> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(sys(|| "prctl(PR_SET_PDEATHSIG)".into()))?;
    if nix::unistd::getppid().as_raw() != i32::try_from(spec.parent).unwrap_or(-1) {
        return Err(SandboxError::ParentGone);
    }
    if spec.argv.is_empty() && spec.exe.is_none() {
        return Err(SandboxError::Invalid("the container has no command".into()));
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)
        .map_err(io(|| format!("opening the log {}", spec.log.display())))?;
    let exe = match &spec.exe {
        Some(p) => Some(std::fs::File::open(p).map_err(io(|| format!("opening {}", p.display())))?),
        None => None,
    };
    if let Some(netns) = &spec.netns {
        let file = std::fs::File::open(netns).map_err(io(|| format!("opening {}", netns.display())))?;
        nix::sched::setns(file, CloneFlags::CLONE_NEWNET)
            .map_err(sys(|| format!("setns({}) of the pod's network", netns.display())))?;
    }
    enter_namespaces()?;
    let hostname: String = spec.hostname.chars().take(63).collect();
    if !hostname.is_empty() {
        nix::unistd::sethostname(&hostname).map_err(sys(|| "sethostname".into()))?;
    }
    // Sources are opened inside the new namespace (bind mounts need their
    // source there) and before any mount can hide them.
    let mut sources = Vec::with_capacity(spec.mounts.len());
    for m in &spec.mounts {
        sources.push(open_path(&m.source)?);
    }
    let mut targets = Vec::with_capacity(spec.mounts.len());
    for m in &spec.mounts {
        targets.push(normalize(&m.target)?);
    }
    let cwd = spec.cwd.as_deref().map(normalize).transpose()?;
    let needs_new_root = targets
        .iter()
        .chain(cwd.iter())
        .any(|t| split_existing(t).0 == Path::new("/") && !t.exists());
    let mut owned = Owned::default();
    if needs_new_root {
        new_root(&spec.stage)?;
        owned.shadows.push(PathBuf::from("/"));
    }
    for ((m, target), source) in spec.mounts.iter().zip(&targets).zip(&sources) {
        let dir = is_dir_fd(source)?;
        ensure_target(target, !dir, &mut owned)?;
        let from = fd_path(source);
        bind(&from, target, dir)?;
        if m.read_only {
            nix::mount::mount(
                None::<&str>,
                target.as_path(),
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
                None::<&str>,
            )
            .map_err(sys(|| format!("making {} read-only", target.display())))?;
        }
        if dir {
            owned
                .trees
                .push(std::fs::canonicalize(target).unwrap_or_else(|_| target.clone()));
        }
    }
    if let Some(dir) = &cwd {
        ensure_target(dir, false, &mut owned)?;
    }
    if needs_new_root {
        drop_old_root()?;
    }
    drop(sources);
    let path_var = spec
        .env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map_or(DEFAULT_PATH, |(_, v)| v.as_str());
    let program = match &exe {
        // Reopened by PID 1 through this process's descriptor table.
        Some(f) => PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), f.as_raw_fd())),
        None => resolve_program(&spec.argv[0], path_var)?,
    };
    let argv0 = spec.argv.first().cloned().unwrap_or_else(|| "skipper".into());
    let stdout = log.try_clone().map_err(io(|| "duplicating the log".into()))?;
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg(SUBCOMMAND)
        .arg("init")
        .arg(&program)
        .arg("--")
        .arg(argv0)
        .args(spec.argv.iter().skip(1))
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(cwd.as_deref().unwrap_or(Path::new("/")))
        .stdin(Stdio::null())
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(log));
    let child = cmd
        .spawn()
        .map_err(io(|| "starting the container process".into()))?;
    Ok((child, exe))
}

/// `__sandbox init <program> -- <argv...>`: PID 1 of the container.
fn init(args: &[OsString]) -> ExitCode {
    let fail = |what: String| {
        eprintln!("{what}");
        ExitCode::from(128)
    };
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        return fail(format!("prctl(PR_SET_PDEATHSIG): {e}"));
    }
    let (Some(program), Some(sep)) = (args.first(), args.get(1)) else {
        return fail("usage: __sandbox init PROGRAM -- ARGV...".into());
    };
    if sep != "--" || args.len() < 3 {
        return fail("usage: __sandbox init PROGRAM -- ARGV...".into());
    }
    let to_c = |s: &OsStr| CString::new(s.as_bytes()).ok();
    let argv: Vec<CString> = args[2..].iter().filter_map(|a| to_c(a)).collect();
    let envp: Vec<CString> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            to_c(&kv)
        })
        .collect();
    let program = Path::new(program);
    // An image binary is held open by the shim; reopen it before /proc changes.
    let held = if program.starts_with("/proc/") {
        match std::fs::File::open(program) {
            Ok(f) => Some(f),
            Err(e) => return fail(format!("exec {}: {e}", program.display())),
        }
    } else {
        None
    };
    if let Err(e) = nix::mount::mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    ) {
        return fail(format!("mounting /proc: {e}"));
    }
    let err = match held {
        Some(f) => nix::unistd::fexecve(f.as_fd(), &argv, &envp).err(),
        None => match to_c(program.as_os_str()) {
            Some(path) => nix::unistd::execve(&path, &argv, &envp).err(),
            None => Some(Errno::EINVAL),
        },
    };
    fail(format!(
        "exec {}: {}",
        args[2].to_string_lossy(),
        err.map_or_else(|| "failed".to_owned(), |e| e.to_string())
    ))
}

/// `__sandbox exec --target PID [--cwd DIR] -- ARGV...`: runs a command in
/// the namespaces of the container whose main process is `PID`, and exits
/// with its status. The command dies with this process (the caller kills it
/// to enforce a timeout).
fn exec(args: &[OsString]) -> ExitCode {
    let fail = |what: String| {
        eprintln!("{what}");
        ExitCode::from(126)
    };
    let mut target = None;
    let mut cwd = PathBuf::from("/");
    let mut i = 0;
    while i < args.len() && args[i] != "--" {
        let value = args.get(i + 1).map(|v| v.to_string_lossy().into_owned());
        match (args[i].to_string_lossy().as_ref(), value) {
            ("--target", Some(v)) => target = v.parse::<u32>().ok(),
            ("--cwd", Some(v)) => cwd = PathBuf::from(v),
            (flag, _) => return fail(format!("__sandbox exec: unknown flag {flag}")),
        }
        i += 2;
    }
    let (Some(pid), Some(argv)) = (target, args.get(i + 1..).filter(|a| !a.is_empty())) else {
        return fail("usage: __sandbox exec --target PID [--cwd DIR] -- ARGV...".into());
    };
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        return fail(format!("prctl(PR_SET_PDEATHSIG): {e}"));
    }
    if let Err(e) = join_namespaces(pid) {
        return fail(e.to_string());
    }
    if nix::unistd::chdir(&cwd).is_err() {
        let _ = nix::unistd::chdir("/");
    }
    // A child joins the PID namespace; it asks to die with this process.
    let child = Command::new("/proc/self/exe")
        .args([SUBCOMMAND, "exec-child", "--"])
        .args(argv)
        .stdin(Stdio::null())
        .spawn();
    match child.and_then(|mut c| c.wait()) {
        Ok(s) => exit_code(s),
        Err(e) => fail(format!("exec {:?}: {e}", argv[0])),
    }
}

/// `__sandbox exec-child -- ARGV...`: dies with its parent, then becomes ARGV
/// (found on `PATH`).
fn exec_child(args: &[OsString]) -> ExitCode {
    let fail = |what: String| {
        eprintln!("{what}");
        ExitCode::from(127)
    };
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        return fail(format!("prctl(PR_SET_PDEATHSIG): {e}"));
    }
    let argv: Vec<CString> = args
        .iter()
        .skip_while(|a| *a != "--")
        .skip(1)
        .filter_map(|a| CString::new(a.as_bytes()).ok())
        .collect();
    let Some(program) = argv.first() else {
        return fail("usage: __sandbox exec-child -- ARGV...".into());
    };
    let err = nix::unistd::execvp(program, &argv).err();
    fail(format!(
        "exec {:?}: {}",
        program,
        err.map_or_else(|| "failed".to_owned(), |e| e.to_string())
    ))
}

fn join_namespaces(pid: u32) -> Result<(), SandboxError> {
    let open = |ns: &str| {
        std::fs::File::open(format!("/proc/{pid}/ns/{ns}"))
            .map_err(io(|| format!("opening /proc/{pid}/ns/{ns}")))
    };
    let same = |ns: &str| {
        std::fs::read_link(format!("/proc/self/ns/{ns}")).ok()
            == std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok()
    };
    // The pod's network first: joining it needs the capabilities of the
    // initial user namespace (a pod has its own network only under root).
    if !same("net") {
        nix::sched::setns(open("net")?, CloneFlags::CLONE_NEWNET).map_err(sys(|| "setns(net)".into()))?;
    }
    if !same("user") {
        nix::sched::setns(open("user")?, CloneFlags::CLONE_NEWUSER).map_err(sys(|| "setns(user)".into()))?;
    }
    let (uts, mnt, pidns) = (open("uts")?, open("mnt")?, open("pid")?);
    nix::sched::setns(uts, CloneFlags::CLONE_NEWUTS).map_err(sys(|| "setns(uts)".into()))?;
    nix::sched::setns(pidns, CloneFlags::CLONE_NEWPID).map_err(sys(|| "setns(pid)".into()))?;
    nix::sched::setns(mnt, CloneFlags::CLONE_NEWNS).map_err(sys(|| "setns(mnt)".into()))
}

/// Tries, in this process, what every sandbox needs.
fn check_here() -> Result<(), SandboxError> {
    enter_namespaces()?;
    mount_tmpfs(Path::new("/tmp"), 0o1777)
}

/// Why pods cannot get sandboxes here, in one line.
#[must_use]
pub fn unavailable_message(is_root: bool, failure: &str) -> String {
    let hint = if is_root {
        "the process lacks CAP_SYS_ADMIN (run it with full privileges)"
    } else {
        "run as root, or enable unprivileged user namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1)"
    };
    format!(
        "pods need private mount and PID namespaces, which this process cannot create ({}): {hint}",
        failure.trim()
    )
}

/// Whether `exe` (a skipper binary) can create sandboxes here; the reason
/// in one line when it cannot.
///
/// # Errors
/// The [`unavailable_message`] text.
pub async fn check(exe: &Path) -> Result<(), String> {
    let is_root = nix::unistd::geteuid().is_root();
    let out = tokio::process::Command::new(exe)
        .args([SUBCOMMAND, "check"])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| unavailable_message(is_root, &format!("starting {}: {e}", exe.display())))?;
    if out.status.success() {
        Ok(())
    } else {
        let text = String::from_utf8_lossy(&out.stdout);
        Err(unavailable_message(
            is_root,
            text.lines().next().unwrap_or("unknown error"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_prefixes_resolve_symlinks_and_list_what_is_missing() {
        let (existing, missing) = split_existing(Path::new("/proc/self/nonexistent/a/b"));
        assert!(existing.starts_with("/proc"));
        assert_eq!(missing, [OsString::from("nonexistent"), "a".into(), "b".into()]);
        let (root, missing) = split_existing(Path::new("/definitely-not-here-xyz/x"));
        assert_eq!(root, Path::new("/"));
        assert_eq!(missing.len(), 2);
    }

    #[test]
    fn ownership_of_directories() {
        let owned = Owned {
            shadows: vec!["/run".into()],
            trees: vec!["/data".into()],
        };
        assert!(owned.owns(Path::new("/run")));
        assert!(
            !owned.owns(Path::new("/run/user")),
            "a bound-back subdirectory is the host's"
        );
        assert!(owned.owns(Path::new("/data/deep/er")));
        assert!(!owned.owns(Path::new("/etc")));
    }

    #[test]
    fn programs_resolve_on_path() {
        assert_eq!(
            resolve_program("sh", DEFAULT_PATH).unwrap().file_name().unwrap(),
            "sh"
        );
        assert!(matches!(
            resolve_program("no-such-program-xyz", DEFAULT_PATH),
            Err(SandboxError::NotFound(_))
        ));
        assert!(resolve_program("/no/such/file", DEFAULT_PATH).is_err());
    }

    #[test]
    fn the_unavailable_message_names_what_is_missing() {
        let m = unavailable_message(
            false,
            "unshare(CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWUTS): EPERM: Operation not permitted\n",
        );
        assert!(m.contains("mount and PID namespaces"));
        assert!(m.contains("EPERM"));
        assert!(m.contains("user namespaces"));
        assert!(!m.contains('\n'));
    }

    #[test]
    fn control_lines_round_trip() {
        let line = serde_json::to_string(&Control::Started { pid: 42 }).unwrap();
        assert_eq!(line, r#"{"started":{"pid":42}}"#);
        assert_eq!(
            serde_json::from_str::<Control>(&line).unwrap(),
            Control::Started { pid: 42 }
        );
    }
}
