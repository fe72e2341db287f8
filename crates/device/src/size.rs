//! Human sizes of images and devices: `64M`, `1.5G`, `512KiB`, `4096`.

use thiserror::Error;

/// A size that could not be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("bad size {0:?}: expected a number such as 64M, 1.5G or 4096")]
    Syntax(String),
    #[error("bad size {0:?}: unknown unit {1:?} (use K, M, G or T)")]
    Unit(String, String),
    #[error("size {0:?} is too large")]
    TooLarge(String),
}

/// Parse a size with an optional binary suffix (K, M, G, T; `iB`/`B` allowed) and an
/// optional decimal fraction (`1.5G`); the result is rounded down to whole bytes.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let num_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(num_end);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 18 {
        return Err(SizeError::Syntax(s.to_string()));
    }
    let suffix = suffix.trim().to_ascii_lowercase();
    let shift = match suffix.trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(SizeError::Unit(s.to_string(), suffix)),
    };
    let too_large = || SizeError::TooLarge(s.to_string());
    let int: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_large())?
    };
    let frac_num: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().map_err(|_| SizeError::Syntax(s.to_string()))?
    };
    let frac_den = 10u128.pow(frac.len() as u32);
    let bytes = int
        .checked_shl(shift)
        .filter(|v| v >> shift == int)
        .ok_or_else(too_large)?
        + ((frac_num << shift) / frac_den);
    u64::try_from(bytes).map_err(|_| too_large())
}

/// `1.5 GiB` style rendering for reports.
pub fn human(bytes: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("512k").unwrap(), 512 << 10);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("2T").unwrap(), 2 << 40);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("0.5M").unwrap(), 512 << 10);
        assert_eq!(parse_size(".25K").unwrap(), 256);
        assert_eq!(parse_size("1.5").unwrap(), 1);
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size(".").is_err());
        assert!(parse_size("1.2.3G").is_err());
        assert!(matches!(parse_size("12X"), Err(SizeError::Unit(..))));
        assert!(matches!(
            parse_size("99999999999999999999G"),
            Err(SizeError::TooLarge(_))
        ));
        assert!(matches!(
            parse_size("17000000T"),
            Err(SizeError::TooLarge(_))
        ));
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 20), "3.0 MiB");
    }
}
