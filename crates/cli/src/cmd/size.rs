//! Human sizes on the command line: `64M`, `1G`, `512KiB`, `4096`.

use anyhow::{bail, Context, Result};

/// Parse a size with an optional binary suffix (K, M, G, T; `iB`/`B` allowed) and
/// an optional decimal fraction (`1.5G`; rounded down to whole bytes).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let num_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (int, frac) = match t[..num_end].split_once('.') {
        Some((i, f)) => (i, f),
        None => (&t[..num_end], ""),
    };
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        bail!("bad size {s:?}: expected a number such as 64M, 1.5G or 1G");
    }
    let suffix = t[num_end..].trim().to_ascii_lowercase();
    let shift = match suffix.trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => bail!("bad size {s:?}: unknown unit {suffix:?} (use K, M, G or T)"),
    };
    let too_large = || anyhow::anyhow!("size {s:?} is too large");
    let whole: u64 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_large())?
    };
    let mut bytes = whole.checked_mul(1u64 << shift).ok_or_else(too_large)?;
    if !frac.is_empty() {
        // Exact: fraction digits × unit / 10^digits, in 128 bits.
        let digits = frac.len().min(18) as u32;
        let f: u128 = frac[..digits as usize]
            .parse()
            .with_context(|| format!("bad size {s:?}"))?;
        let part = f * (1u128 << shift) / 10u128.pow(digits);
        bytes = bytes.checked_add(part as u64).ok_or_else(too_large)?;
    }
    Ok(bytes)
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
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("0.5M").unwrap(), 512 << 10);
        assert_eq!(parse_size(".5K").unwrap(), 512);
        assert_eq!(parse_size("2.25GiB").unwrap(), 9 << 28);
        assert_eq!(parse_size("1.0001K").unwrap(), 1024);
        assert!(parse_size("1.2.3G").is_err());
        assert!(parse_size(".G").is_err());
        assert!(parse_size("1.5X").is_err());
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 20), "3.0 MiB");
    }
}
