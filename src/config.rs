//! Flag parsing shared by every subcommand: durations in humantime syntax and
//! comma-separated lists. Every flag also reads `SKIPPER_<FLAG>` (declared per
//! flag with clap's `env`).

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
    fn lists_are_trimmed() {
        assert_eq!(split_list(" a, b ,c,,"), vec!["a", "b", "c"]);
        assert!(split_list("").is_empty());
    }
}
