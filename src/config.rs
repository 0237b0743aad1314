//! Flag parsing shared by every subcommand: durations in humantime syntax,
//! comma-separated lists and booleans as Go's `strconv.ParseBool` reads them.
//! Every flag also reads `SKIPPER_<FLAG>` (declared per flag with clap's
//! `env`).

use std::time::Duration;

/// Parses a duration such as `90s`, `1m30s` or `100ms`.
///
/// # Errors
/// Returns a message naming the expected syntax when `s` is not a duration.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("invalid duration {s:?} ({e}); expected e.g. 90s, 1m30s, 100ms"))
}

/// Parses a duration that must be greater than zero.
///
/// # Errors
/// As [`parse_duration`], and when the duration is zero.
pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err(format!("duration {s:?} must be greater than zero"));
    }
    Ok(d)
}

/// Renders a duration the way flags accept it (`1m 30s` style from humantime,
/// compacted: `1m30s`).
#[must_use]
pub fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string().replace(' ', "")
}

/// Splits a comma-separated list, trimming white space around each element.
/// Empty elements are dropped.
#[must_use]
pub fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The spellings Go's `strconv.ParseBool` accepts, with their value.
pub const BOOL_SPELLINGS: &[(&str, bool)] = &[
    ("1", true),
    ("t", true),
    ("T", true),
    ("TRUE", true),
    ("true", true),
    ("True", true),
    ("0", false),
    ("f", false),
    ("F", false),
    ("FALSE", false),
    ("false", false),
    ("False", false),
];

/// Parses a boolean as Go's `strconv.ParseBool` does (`1`, `t`, `T`,
/// `TRUE`, `true`, `True`, `0`, `f`, `F`, `FALSE`, `false`, `False`), so
/// flags and `SKIPPER_*` variables written for the Go implementation keep
/// working.
///
/// # Errors
/// Names the accepted spellings when `s` is none of them.
pub fn parse_bool(s: &str) -> Result<bool, String> {
    BOOL_SPELLINGS
        .iter()
        .find(|(spelling, _)| *spelling == s)
        .map(|(_, v)| *v)
        .ok_or_else(|| format!("invalid boolean {s:?}; expected one of 1, t, T, TRUE, true, True, 0, f, F, FALSE, false, False"))
}

/// The clap value parser of every boolean flag: [`parse_bool`], with `true`
/// and `false` listed as the possible values in `--help`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GoBool;

impl clap::builder::TypedValueParser for GoBool {
    type Value = bool;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<bool, clap::Error> {
        let text = value.to_str().unwrap_or_default();
        parse_bool(text).map_err(|reason| {
            let name = arg.map_or_else(|| "value".to_owned(), ToString::to_string);
            clap::Error::raw(
                clap::error::ErrorKind::InvalidValue,
                format!("invalid value '{text}' for '{name}': {reason}\n"),
            )
            .with_cmd(cmd)
        })
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        Some(Box::new(
            ["true", "false"]
                .into_iter()
                .map(clap::builder::PossibleValue::new),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_go_style() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_positive_duration("0s").is_err());
        assert_eq!(format_duration(Duration::from_secs(90)), "1m30s");
    }

    #[test]
    fn booleans_parse_as_go_parse_bool() {
        for (s, want) in BOOL_SPELLINGS {
            assert_eq!(parse_bool(s), Ok(*want), "{s}");
        }
        for bad in ["", "yes", "no", "tRUE", "on", " true", "2"] {
            let err = parse_bool(bad).unwrap_err();
            assert!(err.contains("invalid boolean"), "{bad}: {err}");
        }
    }

    #[test]
    fn lists_are_trimmed() {
        assert_eq!(split_list(" a, b ,c,,"), vec!["a", "b", "c"]);
        assert!(split_list("").is_empty());
    }
}
