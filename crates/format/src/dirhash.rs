//! ext4 directory-entry hashes used by htree indexes (ext4-format.md §6.7).
//!
//! The effective hash version is `dx_root_info.hash_version` (0 legacy, 1 half_md4,
//! 2 tea), plus 3 when the superblock carries the "unsigned hash" flag (§2.5):
//! versions 0..=2 sign-extend name bytes, 3..=5 treat them as unsigned. The result
//! follows the kernel, including its remap of `0xFFFFFFFE` (the 32-bit readdir EOF
//! cookie) to `0xFFFFFFFC`.

/// Legacy ("dx_hack") hash, signed chars.
pub const DX_HASH_LEGACY: u8 = 0;
/// Reduced-round MD4 hash, signed chars (mkfs default).
pub const DX_HASH_HALF_MD4: u8 = 1;
/// TEA hash, signed chars.
pub const DX_HASH_TEA: u8 = 2;
/// Legacy hash, unsigned chars.
pub const DX_HASH_LEGACY_UNSIGNED: u8 = 3;
/// half_md4, unsigned chars.
pub const DX_HASH_HALF_MD4_UNSIGNED: u8 = 4;
/// TEA, unsigned chars.
pub const DX_HASH_TEA_UNSIGNED: u8 = 5;

/// Offset added to the on-disk hash version when `s_flags` says "unsigned" (§2.5).
pub const UNSIGNED_VERSION_DELTA: u8 = 3;

/// Seed used when `s_hash_seed` is all zero (§6.7): the MD4 initial state.
pub const DEFAULT_SEED: [u32; 4] = [0x6745_2301, 0xEFCD_AB89, 0x98BA_DCFE, 0x1032_5476];

/// Hash value the kernel never returns: it is the 32-bit readdir EOF cookie (<< 1).
const EOF_HASH: u32 = 0xFFFF_FFFE;
/// What the kernel returns instead of [`EOF_HASH`].
const EOF_REMAP: u32 = 0xFFFF_FFFC;

const TEA_DELTA: u32 = 0x9E37_79B9;
const MD4_K2: u32 = 0x5A82_7999;
const MD4_K3: u32 = 0x6ED9_EBA1;

/// Effective hash version for a directory: the root's version, shifted into the
/// unsigned range when the file system hashes names as unsigned chars (§2.5).
pub fn effective_version(root_hash_version: u8, unsigned_fs: bool) -> u8 {
    if unsigned_fs && root_hash_version <= DX_HASH_TEA {
        root_hash_version + UNSIGNED_VERSION_DELTA
    } else {
        root_hash_version
    }
}

/// Whether `version` is one this module implements (0..=5).
pub fn is_supported_version(version: u8) -> bool {
    version <= DX_HASH_TEA_UNSIGNED
}

/// Directory hash of `name`: returns `(major, minor)`.
///
/// `version` is the effective version (0..=5, see [`effective_version`]); unknown
/// versions fall back to legacy, which is what the hash of a corrupt root would be
/// worth anyway (callers validate the version when parsing the root). `seed` is
/// `s_hash_seed`; an all-zero seed selects [`DEFAULT_SEED`].
pub fn dx_hash(name: &[u8], version: u8, seed: &[u32; 4]) -> (u32, u32) {
    let mut buf = if seed.iter().all(|&w| w == 0) {
        DEFAULT_SEED
    } else {
        *seed
    };
    let unsigned = version >= UNSIGNED_VERSION_DELTA;
    let (major, minor) = match version % UNSIGNED_VERSION_DELTA {
        DX_HASH_HALF_MD4 if is_supported_version(version) => {
            let mut input = [0u32; 8];
            let mut rest = name;
            while !rest.is_empty() {
                str2hashbuf(rest, &mut input, unsigned);
                half_md4_transform(&mut buf, &input);
                rest = rest.get(32..).unwrap_or(&[]);
            }
            (buf[1], buf[2])
        }
        DX_HASH_TEA if is_supported_version(version) => {
            let mut input = [0u32; 4];
            let mut rest = name;
            while !rest.is_empty() {
                str2hashbuf(rest, &mut input, unsigned);
                tea_transform(&mut buf, &input);
                rest = rest.get(16..).unwrap_or(&[]);
            }
            (buf[0], buf[1])
        }
        _ => (legacy_hash(name, unsigned), 0),
    };
    let mut major = major & !1;
    if major == EOF_HASH {
        major = EOF_REMAP;
    }
    (major, minor)
}

/// Byte value as the C code sees a `char`: sign-extended or not.
#[inline]
fn char_value(b: u8, unsigned: bool) -> u32 {
    if unsigned {
        u32::from(b)
    } else {
        i32::from(b as i8) as u32
    }
}

/// The legacy "dx_hack" hash; returns `hash0 << 1` as the kernel does.
fn legacy_hash(name: &[u8], unsigned: bool) -> u32 {
    let (mut h0, mut h1): (u32, u32) = (0x12A3_FE2D, 0x37AB_E8F9);
    for &b in name {
        let c = char_value(b, unsigned);
        let mut h = h1.wrapping_add(h0 ^ c.wrapping_mul(7_152_373));
        if h & 0x8000_0000 != 0 {
            h = h.wrapping_sub(0x7FFF_FFFF);
        }
        h1 = h0;
        h0 = h;
    }
    h0 << 1
}

/// Pack the start of `msg` into `out.len()` words (§6.7 `str2hashbuf`). The padding
/// word encodes the *remaining* length, which is why `msg` is the whole tail.
fn str2hashbuf(msg: &[u8], out: &mut [u32], unsigned: bool) {
    let len = msg.len() as u32;
    let mut pad = len | (len << 8);
    pad |= pad << 16;
    let take = msg.len().min(out.len() * 4);
    let mut val = pad;
    let mut w = 0;
    for (i, &b) in msg[..take].iter().enumerate() {
        val = char_value(b, unsigned).wrapping_add(val << 8);
        if i % 4 == 3 {
            out[w] = val;
            w += 1;
            val = pad;
        }
    }
    if w < out.len() {
        out[w] = val;
        w += 1;
    }
    for slot in &mut out[w..] {
        *slot = pad;
    }
}

fn tea_transform(buf: &mut [u32; 4], input: &[u32; 4]) {
    let (mut b0, mut b1) = (buf[0], buf[1]);
    let [a, b, c, d] = *input;
    let mut sum: u32 = 0;
    for _ in 0..16 {
        sum = sum.wrapping_add(TEA_DELTA);
        b0 = b0.wrapping_add(
            ((b1 << 4).wrapping_add(a)) ^ b1.wrapping_add(sum) ^ ((b1 >> 5).wrapping_add(b)),
        );
        b1 = b1.wrapping_add(
            ((b0 << 4).wrapping_add(c)) ^ b0.wrapping_add(sum) ^ ((b0 >> 5).wrapping_add(d)),
        );
    }
    buf[0] = buf[0].wrapping_add(b0);
    buf[1] = buf[1].wrapping_add(b1);
}

#[inline]
fn md4_f(x: u32, y: u32, z: u32) -> u32 {
    z ^ (x & (y ^ z))
}
#[inline]
fn md4_g(x: u32, y: u32, z: u32) -> u32 {
    (x & y).wrapping_add((x ^ y) & z)
}
#[inline]
fn md4_h(x: u32, y: u32, z: u32) -> u32 {
    x ^ y ^ z
}

/// One round of the reduced MD4: its mixing function, additive constant, and for each
/// of the 8 steps the input word index and rotation.
struct Md4Round {
    f: fn(u32, u32, u32) -> u32,
    k: u32,
    steps: [(usize, u32); 8],
}

const MD4_ROUNDS: [Md4Round; 3] = [
    Md4Round {
        f: md4_f,
        k: 0,
        steps: [
            (0, 3),
            (1, 7),
            (2, 11),
            (3, 19),
            (4, 3),
            (5, 7),
            (6, 11),
            (7, 19),
        ],
    },
    Md4Round {
        f: md4_g,
        k: MD4_K2,
        steps: [
            (1, 3),
            (3, 5),
            (5, 9),
            (7, 13),
            (0, 3),
            (2, 5),
            (4, 9),
            (6, 13),
        ],
    },
    Md4Round {
        f: md4_h,
        k: MD4_K3,
        steps: [
            (3, 3),
            (7, 9),
            (2, 11),
            (6, 15),
            (1, 3),
            (5, 9),
            (0, 11),
            (4, 15),
        ],
    },
];

/// The 3-round, 24-step reduced MD4 of §6.7 on state `buf` = (a, b, c, d). The
/// updated variable cycles a, d, c, b; the function takes the next three in the
/// cycle a→b→c→d.
fn half_md4_transform(buf: &mut [u32; 4], input: &[u32; 8]) {
    const ORDER: [usize; 4] = [0, 3, 2, 1];
    let mut s = *buf;
    for round in &MD4_ROUNDS {
        for (step, &(i, shift)) in round.steps.iter().enumerate() {
            let v = ORDER[step % 4];
            let (x, y, z) = (s[(v + 1) % 4], s[(v + 2) % 4], s[(v + 3) % 4]);
            s[v] = s[v]
                .wrapping_add((round.f)(x, y, z))
                .wrapping_add(input[i].wrapping_add(round.k))
                .rotate_left(shift);
        }
    }
    for (b, v) in buf.iter_mut().zip(s) {
        *b = b.wrapping_add(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: [u32; 4] = [0x4084_E05B, 0x4A4C_F4E5, 0x5F04_729C, 0xB21E_4600];

    #[test]
    fn reference_vector_half_md4_signed() {
        // ext4-format.md §6.7 test vector from a real image.
        let (major, minor) = dx_hash(b"file_with_a_longish_name_241", DX_HASH_HALF_MD4, &SEED);
        assert_eq!(major, 0x0076_7446);
        assert_eq!(minor, 0xB1FF_C864);
    }

    #[test]
    fn ascii_names_hash_equal_signed_and_unsigned() {
        for v in 0..3u8 {
            let s = dx_hash(b"plain-ascii.txt", v, &SEED);
            let u = dx_hash(b"plain-ascii.txt", v + 3, &SEED);
            assert_eq!(s, u, "version {v}");
        }
        // A high byte must make them differ.
        for v in 0..3u8 {
            let s = dx_hash(b"caf\xc3\xa9", v, &SEED);
            let u = dx_hash(b"caf\xc3\xa9", v + 3, &SEED);
            assert_ne!(s, u, "version {v}");
        }
    }

    #[test]
    fn zero_seed_means_default_seed() {
        for v in 0..6u8 {
            assert_eq!(
                dx_hash(b"abc", v, &[0; 4]),
                dx_hash(b"abc", v, &DEFAULT_SEED)
            );
        }
    }

    #[test]
    fn major_is_even_and_never_eof() {
        for i in 0..5000u32 {
            let name = format!("n{i}");
            for v in 0..6u8 {
                let (major, _) = dx_hash(name.as_bytes(), v, &SEED);
                assert_eq!(major & 1, 0);
                assert_ne!(major, EOF_HASH);
            }
        }
    }

    /// Seed words as the UUID string debugfs's `-s` takes (words are stored le32).
    fn seed_uuid(seed: &[u32; 4]) -> String {
        let b: Vec<u8> = seed.iter().flat_map(|w| w.to_le_bytes()).collect();
        let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
        format!(
            "{}-{}-{}-{}-{}",
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        )
    }

    /// Random names (seeded `rand`) over bytes debugfs's command parser passes through
    /// unchanged: printable ASCII without blanks/quotes/backslash/'#', plus 0x80..0xFF.
    fn random_names(count: usize, state: u64) -> Vec<Vec<u8>> {
        use rand::{RngCore, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(state);
        let mut next = move || rng.next_u64();
        let alphabet: Vec<u8> = (0x21u8..0x7F)
            .filter(|c| !b"\"'\\#".contains(c))
            .chain(0x80..=0xFF)
            .collect();
        (0..count)
            .map(|i| {
                // Cover every length class: short, around chunk edges, up to 255.
                let len = match i % 5 {
                    0 => 1 + (next() % 4) as usize,
                    1 => 14 + (next() % 6) as usize,
                    2 => 30 + (next() % 6) as usize,
                    3 => 1 + (next() % 255) as usize,
                    _ => 250 + (next() % 6) as usize,
                };
                (0..len)
                    .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                    .collect()
            })
            .collect()
    }

    #[test]
    fn debugfs_oracle_all_versions() {
        use crate::dx::testimg::{run, TempDir};
        use std::os::unix::ffi::OsStrExt;
        let tmp = TempDir::new("dirhash");
        let img = tmp.0.join("img");
        let img_s = img.to_str().unwrap();
        let (rc, o, e) = run("mkfs.ext4", &["-q", "-F", img_s, "8M"]);
        assert_eq!(rc, 0, "{o}{e}");
        let names = random_names(400, 0x9E37_79B9_7F4A_7C15);
        for seed in [SEED, [0; 4], [0xFFFF_FFFF, 1, 0x8000_0000, 0x1234_5678]] {
            let mut script = Vec::new();
            let mut expected = Vec::new();
            for v in 0..6u8 {
                for name in &names {
                    script.extend_from_slice(
                        format!("dx_hash -h {v} -s {} -- ", seed_uuid(&seed)).as_bytes(),
                    );
                    script.extend_from_slice(name);
                    script.push(b'\n');
                    expected.push((v, name.clone(), dx_hash(name, v, &seed)));
                }
            }
            let cmd = tmp.0.join("cmds");
            std::fs::write(&cmd, &script).unwrap();
            let out = std::process::Command::new("debugfs")
                .arg("-f")
                .arg(std::ffi::OsStr::from_bytes(cmd.as_os_str().as_bytes()))
                .arg(&img)
                .output()
                .unwrap();
            let results: Vec<(u32, u32)> = out
                .stdout
                .split(|&b| b == b'\n')
                .filter(|l| l.starts_with(b"Hash of "))
                .map(|l| {
                    let l = String::from_utf8_lossy(l);
                    let tail = l.rsplit(" is 0x").next().unwrap();
                    let (maj, rest) = tail.split_once(" (minor 0x").unwrap();
                    let min = rest.trim_end_matches(')');
                    (
                        u32::from_str_radix(maj, 16).unwrap(),
                        u32::from_str_radix(min, 16).unwrap(),
                    )
                })
                .collect();
            assert_eq!(
                results.len(),
                expected.len(),
                "debugfs output count; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            for ((v, name, ours), theirs) in expected.iter().zip(&results) {
                // e2fsprogs does not apply the kernel's EOF remap (§6.7).
                let theirs = if theirs.0 == EOF_HASH {
                    (EOF_REMAP, theirs.1)
                } else {
                    *theirs
                };
                assert_eq!(
                    *ours,
                    theirs,
                    "version {v} seed {seed:x?} name {:?}",
                    String::from_utf8_lossy(name)
                );
            }
        }
    }

    #[test]
    fn effective_version_adds_three_for_unsigned() {
        assert_eq!(effective_version(1, false), 1);
        assert_eq!(effective_version(1, true), 4);
        assert_eq!(effective_version(2, true), 5);
    }
}
