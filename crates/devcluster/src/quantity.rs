//! Kubernetes resource quantities (`250m`, `1.5`, `256Mi`, `1e3`, `2G`) as
//! integers: CPU in millicores, everything else in whole units (bytes,
//! pods). Shared by the scheduler and the kubelet; no I/O.

/// A quantity in milli-units (`1` is 1000, `250m` is 250, `1Ki` is 1 024 000).
///
/// `None` for text that is not a Kubernetes quantity.
#[must_use]
pub fn parse_milli(s: &str) -> Option<i128> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    let (number, suffix) = split_suffix(s);
    let (mantissa_milli, scale_pow10) = parse_decimal(number)?;
    // (multiplier numerator, power of ten) of the suffix.
    let (mult, pow10): (i128, i32) = match suffix {
        "" => (1, 0),
        "n" => (1, -9),
        "u" => (1, -6),
        "m" => (1, -3),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        "E" => (1, 18),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        exp if exp.starts_with(['e', 'E']) => (1, exp[1..].parse::<i32>().ok()?),
        _ => return None,
    };
    let value = mantissa_milli.checked_mul(mult)?;
    let pow = pow10 + scale_pow10;
    if pow >= 0 {
        value.checked_mul(10i128.checked_pow(u32::try_from(pow).ok()?)?)
    } else {
        let div = 10i128.checked_pow(u32::try_from(-pow).ok()?)?;
        // Kubernetes rounds fractional milli-values up.
        Some((value + div - 1).div_euclid(div))
    }
}

/// A quantity in whole units, rounded up (`1500m` is 2, `1Ki` is 1024).
#[must_use]
pub fn parse_units(s: &str) -> Option<i128> {
    parse_milli(s).map(|m| (m + 999).div_euclid(1000))
}

/// Splits `123.5Mi` into (`123.5`, `Mi`); an exponent (`1e3`) is a suffix.
fn split_suffix(s: &str) -> (&str, &str) {
    let digits = s
        .char_indices()
        .find(|(i, c)| !(c.is_ascii_digit() || *c == '.' || ((*c == '+' || *c == '-') && *i == 0)))
        .map_or(s.len(), |(i, _)| i);
    s.split_at(digits)
}

/// `12.345` → (12345 × 1000, −3): the digits as milli-units and the power
/// of ten that places the decimal point.
fn parse_decimal(s: &str) -> Option<(i128, i32)> {
    let (negative, s) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    if s.is_empty() || s == "." {
        return None;
    }
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    if !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits: String = format!("{int}{frac}");
    let mantissa: i128 = if digits.is_empty() {
        0
    } else {
        digits.parse().ok()?
    };
    let frac_len = i32::try_from(frac.len()).ok()?;
    let m = mantissa.checked_mul(1000)?;
    Some((if negative { -m } else { m }, -frac_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_memory_quantities_parse_like_kubernetes() {
        for (text, milli) in [
            ("250m", 250),
            ("1", 1000),
            ("0.5", 500),
            ("1.5", 1500),
            ("2", 2000),
            ("100u", 1),
            ("1Ki", 1_024_000),
            ("256Mi", 268_435_456_000),
            ("1Gi", 1_073_741_824_000),
            ("1k", 1_000_000),
            ("2G", 2_000_000_000_000),
            ("1e3", 1_000_000),
            ("1.5e3", 1_500_000),
            ("0", 0),
        ] {
            assert_eq!(parse_milli(text), Some(milli), "{text}");
        }
        assert_eq!(parse_units("1500m"), Some(2));
        assert_eq!(parse_units("128974848"), Some(128_974_848));
        assert_eq!(parse_units("32Mi"), Some(33_554_432));
        for bad in ["", "abc", "1X", "1.2.3", "Mi", "."] {
            assert_eq!(parse_milli(bad), None, "{bad}");
        }
    }
}
