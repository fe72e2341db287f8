//! Block and inode bitmaps (ext4-format.md §3.4) and their checksums (§1.3).

use crate::csum::{crc32c_raw, CsumCtx};

#[inline]
pub fn test_bit(b: &[u8], n: usize) -> bool {
    b[n >> 3] & (1 << (n & 7)) != 0
}
#[inline]
pub fn set_bit(b: &mut [u8], n: usize) {
    b[n >> 3] |= 1 << (n & 7);
}
#[inline]
pub fn clear_bit(b: &mut [u8], n: usize) {
    b[n >> 3] &= !(1 << (n & 7));
}

/// Bitmap checksum: crc32c(fs_seed) over the first `bits / 8` bytes only (§1.3: not the
/// whole block, and no group number, contrary to the kernel documentation).
pub fn checksum(b: &[u8], bits: u32, csum: &CsumCtx) -> u32 {
    let n = (bits as usize / 8).min(b.len());
    crc32c_raw(csum.fs_seed, &b[..n])
}

/// Number of zero bits among the first `bits` bits.
pub fn count_zeros(b: &[u8], bits: usize) -> usize {
    let full = bits / 8;
    let mut z: usize = b[..full].iter().map(|x| x.count_zeros() as usize).sum();
    for n in full * 8..bits {
        if !test_bit(b, n) {
            z += 1;
        }
    }
    z
}

/// Set every bit from `from` to the end of the block (padding must read as used, §3.4).
pub fn set_padding(b: &mut [u8], from: usize) {
    let total = b.len() * 8;
    let mut n = from;
    while n < total && !n.is_multiple_of(8) {
        set_bit(b, n);
        n += 1;
    }
    for byte in &mut b[n / 8..] {
        *byte = 0xFF;
    }
}

/// First zero bit in `[start, end)`, if any.
pub fn find_zero(b: &[u8], start: usize, end: usize) -> Option<usize> {
    let mut n = start;
    while n < end {
        if n.is_multiple_of(64) && n + 64 <= end {
            let w = u64::from_le_bytes(b[n / 8..n / 8 + 8].try_into().unwrap());
            if w == u64::MAX {
                n += 64;
                continue;
            }
            return Some(n + (!w).trailing_zeros() as usize);
        }
        if !test_bit(b, n) {
            return Some(n);
        }
        n += 1;
    }
    None
}

/// Length of the run of zero bits starting at `start`, capped at `max` and `end`.
pub fn zero_run(b: &[u8], start: usize, end: usize, max: usize) -> usize {
    let mut n = start;
    let lim = end.min(start.saturating_add(max));
    while n < lim {
        if n.is_multiple_of(64) && n + 64 <= lim {
            let w = u64::from_le_bytes(b[n / 8..n / 8 + 8].try_into().unwrap());
            if w == 0 {
                n += 64;
                continue;
            }
            return n + w.trailing_zeros() as usize - start;
        }
        if test_bit(b, n) {
            break;
        }
        n += 1;
    }
    n - start
}

/// Word `wi` of a bitmap with `mask` ORed in (`mask` in the layout of
/// `u64::from_le_bytes` over `b`; words past its end are zero).
fn masked_word(b: &[u8], mask: &[u64], wi: usize) -> u64 {
    u64::from_le_bytes(b[wi * 8..wi * 8 + 8].try_into().unwrap())
        | mask.get(wi).copied().unwrap_or(0)
}

fn masked_bit(b: &[u8], mask: &[u64], n: usize) -> bool {
    test_bit(b, n) || mask.get(n / 64).is_some_and(|w| w & (1 << (n % 64)) != 0)
}

/// [`find_zero`] over `b | mask`: the first bit at or after `start` that is
/// clear in both (the allocator's view of a group with blocks that may not
/// be reused yet).
pub fn find_zero_masked(b: &[u8], mask: &[u64], start: usize, end: usize) -> Option<usize> {
    let mut n = start;
    while n < end {
        if n.is_multiple_of(64) && n + 64 <= end {
            let w = masked_word(b, mask, n / 64);
            if w == u64::MAX {
                n += 64;
                continue;
            }
            return Some(n + (!w).trailing_zeros() as usize);
        }
        if !masked_bit(b, mask, n) {
            return Some(n);
        }
        n += 1;
    }
    None
}

/// [`zero_run`] over `b | mask`.
pub fn zero_run_masked(b: &[u8], mask: &[u64], start: usize, end: usize, max: usize) -> usize {
    let mut n = start;
    let lim = end.min(start.saturating_add(max));
    while n < lim {
        if n.is_multiple_of(64) && n + 64 <= lim {
            let w = masked_word(b, mask, n / 64);
            if w == 0 {
                n += 64;
                continue;
            }
            return n + w.trailing_zeros() as usize - start;
        }
        if masked_bit(b, mask, n) {
            break;
        }
        n += 1;
    }
    n - start
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_and_runs() {
        let mut b = vec![0xFFu8; 32];
        clear_bit(&mut b, 77);
        clear_bit(&mut b, 78);
        clear_bit(&mut b, 200);
        assert_eq!(find_zero(&b, 0, 256), Some(77));
        assert_eq!(find_zero(&b, 79, 256), Some(200));
        assert_eq!(find_zero(&b, 201, 256), None);
        assert_eq!(zero_run(&b, 77, 256, 100), 2);
        assert_eq!(count_zeros(&b, 256), 3);
        assert_eq!(count_zeros(&b, 78), 1);
        let mut z = vec![0u8; 32];
        assert_eq!(zero_run(&z, 3, 256, 1000), 253);
        set_padding(&mut z, 100);
        assert_eq!(count_zeros(&z, 256), 100);
        assert!(test_bit(&z, 100) && !test_bit(&z, 99));
    }

    proptest::proptest! {
        /// The masked searches answer as the plain ones over `b | mask`.
        #[test]
        fn masked_searches_are_searches_of_the_union(
            b in proptest::collection::vec(proptest::prelude::any::<u8>(), 32),
            sparse in proptest::collection::vec(0usize..256, 0..40),
            mask_words in 0usize..5,
            start in 0usize..256,
            end in 0usize..=256,
            max in 1usize..300,
        ) {
            let mut mask = vec![0u64; mask_words];
            for &i in &sparse {
                if i / 64 < mask.len() {
                    mask[i / 64] |= 1 << (i % 64);
                }
            }
            let mut union = b.clone();
            for (wi, w) in mask.iter().enumerate() {
                for (k, byte) in w.to_le_bytes().iter().enumerate() {
                    union[wi * 8 + k] |= byte;
                }
            }
            let want = find_zero(&union, start, end);
            proptest::prop_assert_eq!(find_zero_masked(&b, &mask, start, end), want);
            if let Some(z) = want {
                proptest::prop_assert_eq!(
                    zero_run_masked(&b, &mask, z, end, max),
                    zero_run(&union, z, end, max)
                );
            }
        }
    }
}
