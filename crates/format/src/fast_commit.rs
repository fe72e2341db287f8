//! Fast-commit area records (ext4-format.md §9): the TLVs, a packer that lays out one
//! fast commit exactly like the kernel's writer (§9.4), the CRC (§9.5) and a scanner
//! implementing the kernel's validation rules (§9.6).
//!
//! Nothing here does I/O. The writer builds one fast commit with [`FcPacker`] and
//! writes the returned blocks at consecutive fast-commit-area blocks; recovery feeds
//! the area's blocks, in order, to [`FcScanner`] (or [`scan_blocks`]) and replays
//! [`FcScan::tags`].
//!
//! Every decoder validates lengths before touching bytes: arbitrary block contents
//! give an [`FcError`] or a scan end reason, never a panic.

use std::borrow::Cow;

use crate::bytes::{le16, le32, put_le16, put_le32};
use crate::csum::crc32c_raw;
use crate::extent::{decode_len, encode_len, PBLK_LIMIT};
use crate::inode::GOOD_OLD_INODE_SIZE;

/// `EXT4_FC_TAG_ADD_RANGE` (§9.3).
pub const TAG_ADD_RANGE: u16 = 0x0001;
/// `EXT4_FC_TAG_DEL_RANGE`.
pub const TAG_DEL_RANGE: u16 = 0x0002;
/// `EXT4_FC_TAG_CREAT` (kernel debug name "CREAT_DENTRY").
pub const TAG_CREAT: u16 = 0x0003;
/// `EXT4_FC_TAG_LINK` ("ADD_ENTRY").
pub const TAG_LINK: u16 = 0x0004;
/// `EXT4_FC_TAG_UNLINK` ("DEL_ENTRY").
pub const TAG_UNLINK: u16 = 0x0005;
/// `EXT4_FC_TAG_INODE`.
pub const TAG_INODE: u16 = 0x0006;
/// `EXT4_FC_TAG_PAD`.
pub const TAG_PAD: u16 = 0x0007;
/// `EXT4_FC_TAG_TAIL`.
pub const TAG_TAIL: u16 = 0x0008;
/// `EXT4_FC_TAG_HEAD`.
pub const TAG_HEAD: u16 = 0x0009;

/// commitfs extension `DATA_CSUM` (docs/FORMAT.md, `-o fc_data_csum`): CRC32C of
/// the data in `pblk..pblk+len` (file blocks `lblk..`) as the fsync left it. Only
/// valid on images with [`crate::superblock::INCOMPAT_COMMITFS_FC_DATA_CSUM`]; the
/// kernel's scan rejects the tag, which is why that incompat bit exists.
pub const TAG_DATA_CSUM: u16 = 0x8001;
/// Value length of DATA_CSUM: `ino`, `lblk`, `len`, `pblk` (u64), `crc`.
pub const DATA_CSUM_LEN: usize = 24;
/// commitfs extension `DATA_CHAIN` (docs/FORMAT.md, `-o fc_data_csum`, chained
/// fast commits): this fast commit was written before the flush that makes the
/// previous one durable had completed, so its presence does not prove the
/// previous commit's data durable and recovery verifies that commit's DATA_CSUM
/// records too. Empty value. Same validity rule as [`TAG_DATA_CSUM`].
pub const TAG_DATA_CHAIN: u16 = 0x8002;

/// CRC32C of data blocks for DATA_CSUM: register seeded with `!0`, as the ext4
/// metadata checksums (ext4-format.md §1.3), over the bytes of the whole range.
pub fn data_crc(crc: u32, bytes: &[u8]) -> u32 {
    crc32c_raw(crc, bytes)
}
/// Seed of [`data_crc`].
pub const DATA_CRC_SEED: u32 = !0;

/// Tag + length header of every TLV (`EXT4_FC_TAG_BASE_LEN`, §9.2).
pub const TL_LEN: usize = 4;
/// Value length of ADD_RANGE: `fc_ino` + a 12-byte `ext4_extent`.
pub const ADD_RANGE_LEN: usize = 16;
/// Value length of DEL_RANGE: `fc_ino`, `fc_lblk`, `fc_len`.
pub const DEL_RANGE_LEN: usize = 12;
/// Fixed part of a dentry value (`fc_parent_ino`, `fc_ino`); the name follows.
pub const DENTRY_FIXED_LEN: usize = 8;
/// Longest name in a dentry TLV (`EXT4_NAME_LEN`).
pub const NAME_MAX: usize = 255;
/// Fixed part of an INODE value (`fc_ino`); the raw inode follows.
pub const INODE_FIXED_LEN: usize = 4;
/// Minimum value length of a TAIL (`fc_tid`, `fc_crc`).
pub const TAIL_LEN: usize = 8;
/// Value length of a HEAD (`fc_features`, `fc_tid`).
pub const HEAD_LEN: usize = 8;
/// `EXT4_FC_SUPPORTED_FEATURES`: no fast-commit features are defined.
pub const SUPPORTED_FEATURES: u32 = 0;
/// Bytes of a TAIL TLV covered by the CRC: tag, length and `fc_tid` (§9.5).
const TAIL_CRC_SPAN: usize = TL_LEN + 4;

/// Errors of TLV encoding and decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FcError {
    #[error("fast-commit TLV truncated: {need} bytes needed, {have} available")]
    Truncated { need: usize, have: usize },
    #[error("fast-commit tag {tag:#06x} with invalid value length {len}")]
    BadLength { tag: u16, len: usize },
    #[error("unknown fast-commit tag {0:#06x}")]
    UnknownTag(u16),
    #[error("fast-commit TLV of {total} bytes never fits a {block_size}-byte block")]
    TooLarge { total: usize, block_size: usize },
    #[error("invalid fast-commit record: {0}")]
    Invalid(&'static str),
}

/// Directory-entry value of CREAT, LINK and UNLINK (§9.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dentry<'a> {
    pub parent: u32,
    pub ino: u32,
    /// Name bytes, 1 to 255, no NUL.
    pub name: Cow<'a, [u8]>,
}

impl Dentry<'_> {
    fn into_owned(self) -> Dentry<'static> {
        Dentry {
            parent: self.parent,
            ino: self.ino,
            name: Cow::Owned(self.name.into_owned()),
        }
    }
}

/// One fast-commit TLV, typed (§9.3). Byte payloads borrow when possible (a writer
/// encodes straight from its buffers; the decoder borrows from the block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tlv<'a> {
    Head {
        features: u32,
        tid: u32,
    },
    /// Logical blocks `lblk..lblk+len` map to `pblk..` (`len` 1..=32768 written,
    /// 1..=32767 unwritten when encoding; decoding accepts what the kernel accepts).
    AddRange {
        ino: u32,
        lblk: u32,
        len: u32,
        pblk: u64,
        unwritten: bool,
    },
    /// Logical blocks `lblk..lblk+len` are a hole.
    DelRange {
        ino: u32,
        lblk: u32,
        len: u32,
    },
    /// commitfs extension [`TAG_DATA_CSUM`]: the data of `pblk..pblk+len` (mapped
    /// at `lblk..` of `ino`) has CRC `crc` ([`data_crc`] from [`DATA_CRC_SEED`]).
    DataCsum {
        ino: u32,
        lblk: u32,
        len: u32,
        pblk: u64,
        crc: u32,
    },
    /// commitfs extension [`TAG_DATA_CHAIN`]: the previous commit's flush had not
    /// completed when this one was written.
    DataChain,
    Creat(Dentry<'a>),
    Link(Dentry<'a>),
    Unlink(Dentry<'a>),
    /// Raw on-disk inode: `128 + i_extra_isize` bytes (the whole record with
    /// INLINE_DATA).
    Inode {
        ino: u32,
        raw: Cow<'a, [u8]>,
    },
    /// `len` zero bytes.
    Pad {
        len: u16,
    },
    /// `len` is the value length (at least 8; the kernel's writer makes the TAIL
    /// reach the end of its block).
    Tail {
        tid: u32,
        crc: u32,
        len: u16,
    },
}

impl<'a> Tlv<'a> {
    /// The on-disk tag number.
    pub fn tag(&self) -> u16 {
        match self {
            Tlv::Head { .. } => TAG_HEAD,
            Tlv::AddRange { .. } => TAG_ADD_RANGE,
            Tlv::DelRange { .. } => TAG_DEL_RANGE,
            Tlv::DataCsum { .. } => TAG_DATA_CSUM,
            Tlv::DataChain => TAG_DATA_CHAIN,
            Tlv::Creat(_) => TAG_CREAT,
            Tlv::Link(_) => TAG_LINK,
            Tlv::Unlink(_) => TAG_UNLINK,
            Tlv::Inode { .. } => TAG_INODE,
            Tlv::Pad { .. } => TAG_PAD,
            Tlv::Tail { .. } => TAG_TAIL,
        }
    }

    /// `fc_len`: bytes of the value.
    pub fn value_len(&self) -> usize {
        match self {
            Tlv::Head { .. } => HEAD_LEN,
            Tlv::AddRange { .. } => ADD_RANGE_LEN,
            Tlv::DelRange { .. } => DEL_RANGE_LEN,
            Tlv::DataCsum { .. } => DATA_CSUM_LEN,
            Tlv::DataChain => 0,
            Tlv::Creat(d) | Tlv::Link(d) | Tlv::Unlink(d) => DENTRY_FIXED_LEN + d.name.len(),
            Tlv::Inode { raw, .. } => INODE_FIXED_LEN + raw.len(),
            Tlv::Pad { len } => *len as usize,
            Tlv::Tail { len, .. } => *len as usize,
        }
    }

    /// Bytes the TLV occupies: header plus value.
    pub fn total_len(&self) -> usize {
        TL_LEN + self.value_len()
    }

    /// The inode the record is about (0 for HEAD, PAD, TAIL).
    pub fn ino(&self) -> u32 {
        match self {
            Tlv::AddRange { ino, .. }
            | Tlv::DelRange { ino, .. }
            | Tlv::DataCsum { ino, .. }
            | Tlv::Inode { ino, .. } => *ino,
            Tlv::Creat(d) | Tlv::Link(d) | Tlv::Unlink(d) => d.ino,
            _ => 0,
        }
    }

    /// Detach from borrowed bytes.
    pub fn into_owned(self) -> Tlv<'static> {
        match self {
            Tlv::Head { features, tid } => Tlv::Head { features, tid },
            Tlv::AddRange {
                ino,
                lblk,
                len,
                pblk,
                unwritten,
            } => Tlv::AddRange {
                ino,
                lblk,
                len,
                pblk,
                unwritten,
            },
            Tlv::DelRange { ino, lblk, len } => Tlv::DelRange { ino, lblk, len },
            Tlv::DataCsum {
                ino,
                lblk,
                len,
                pblk,
                crc,
            } => Tlv::DataCsum {
                ino,
                lblk,
                len,
                pblk,
                crc,
            },
            Tlv::DataChain => Tlv::DataChain,
            Tlv::Creat(d) => Tlv::Creat(d.into_owned()),
            Tlv::Link(d) => Tlv::Link(d.into_owned()),
            Tlv::Unlink(d) => Tlv::Unlink(d.into_owned()),
            Tlv::Inode { ino, raw } => Tlv::Inode {
                ino,
                raw: Cow::Owned(raw.into_owned()),
            },
            Tlv::Pad { len } => Tlv::Pad { len },
            Tlv::Tail { tid, crc, len } => Tlv::Tail { tid, crc, len },
        }
    }

    /// Check that the record can be encoded and passes the kernel's length rules
    /// (§9.3) for an inode size of up to `u16` bytes.
    pub fn validate(&self) -> Result<(), FcError> {
        let problem = match self {
            Tlv::AddRange {
                len,
                pblk,
                unwritten,
                ..
            } => {
                if encode_len(*len, *unwritten).is_none() {
                    Some("ADD_RANGE length out of range")
                } else if pblk.saturating_add(*len as u64) > PBLK_LIMIT {
                    Some("ADD_RANGE physical block beyond 48 bits")
                } else {
                    None
                }
            }
            Tlv::Creat(d) | Tlv::Link(d) | Tlv::Unlink(d) => (d.name.is_empty()
                || d.name.len() > NAME_MAX)
                .then_some("dentry name must be 1 to 255 bytes"),
            Tlv::Inode { raw, .. } => {
                (raw.len() < GOOD_OLD_INODE_SIZE).then_some("INODE record shorter than 128 bytes")
            }
            Tlv::Tail { len, .. } => {
                ((*len as usize) < TAIL_LEN).then_some("TAIL value shorter than 8 bytes")
            }
            _ => None,
        };
        if let Some(p) = problem {
            return Err(FcError::Invalid(p));
        }
        if self.value_len() > u16::MAX as usize {
            return Err(FcError::Invalid("value longer than 65535 bytes"));
        }
        Ok(())
    }

    /// Encode into the start of `dst`; returns the bytes written
    /// ([`Self::total_len`]). PAD values and TAIL padding are written as zeros.
    pub fn encode(&self, dst: &mut [u8]) -> Result<usize, FcError> {
        self.validate()?;
        let total = self.total_len();
        if dst.len() < total {
            return Err(FcError::Truncated {
                need: total,
                have: dst.len(),
            });
        }
        let dst = &mut dst[..total];
        put_le16(dst, 0, self.tag());
        put_le16(dst, 2, self.value_len() as u16);
        let v = &mut dst[TL_LEN..];
        match self {
            Tlv::Head { features, tid } => {
                put_le32(v, 0, *features);
                put_le32(v, 4, *tid);
            }
            Tlv::AddRange {
                ino,
                lblk,
                len,
                pblk,
                unwritten,
            } => {
                put_le32(v, 0, *ino);
                put_le32(v, 4, *lblk);
                // Validated above: the length is encodable.
                put_le16(v, 8, encode_len(*len, *unwritten).unwrap_or(0));
                put_le16(v, 10, (*pblk >> 32) as u16);
                put_le32(v, 12, *pblk as u32);
            }
            Tlv::DelRange { ino, lblk, len } => {
                put_le32(v, 0, *ino);
                put_le32(v, 4, *lblk);
                put_le32(v, 8, *len);
            }
            Tlv::DataCsum {
                ino,
                lblk,
                len,
                pblk,
                crc,
            } => {
                put_le32(v, 0, *ino);
                put_le32(v, 4, *lblk);
                put_le32(v, 8, *len);
                put_le32(v, 12, *pblk as u32);
                put_le32(v, 16, (*pblk >> 32) as u32);
                put_le32(v, 20, *crc);
            }
            Tlv::DataChain => {}
            Tlv::Creat(d) | Tlv::Link(d) | Tlv::Unlink(d) => {
                put_le32(v, 0, d.parent);
                put_le32(v, 4, d.ino);
                v[DENTRY_FIXED_LEN..].copy_from_slice(&d.name);
            }
            Tlv::Inode { ino, raw } => {
                put_le32(v, 0, *ino);
                v[INODE_FIXED_LEN..].copy_from_slice(raw);
            }
            Tlv::Pad { .. } => v.fill(0),
            Tlv::Tail { tid, crc, .. } => {
                v.fill(0);
                put_le32(v, 0, *tid);
                put_le32(v, 4, *crc);
            }
        }
        Ok(total)
    }
}

/// The kernel's `ext4_fc_value_len_isvalid` (§9.3): is `len` a valid value length
/// for `tag`, given the file system's `s_inode_size`? Unknown tags are invalid.
pub fn value_len_valid(tag: u16, len: usize, inode_size: usize) -> bool {
    match tag {
        TAG_ADD_RANGE => len == ADD_RANGE_LEN,
        TAG_DEL_RANGE => len == DEL_RANGE_LEN,
        TAG_CREAT | TAG_LINK | TAG_UNLINK => {
            len > DENTRY_FIXED_LEN && len - DENTRY_FIXED_LEN <= NAME_MAX
        }
        TAG_INODE => {
            len >= INODE_FIXED_LEN + GOOD_OLD_INODE_SIZE && len - INODE_FIXED_LEN <= inode_size
        }
        TAG_PAD => true,
        TAG_TAIL => len >= TAIL_LEN,
        TAG_HEAD => len == HEAD_LEN,
        _ => false,
    }
}

/// Decode the TLV at the start of `buf` (which must end where the block ends: a
/// value may not run past it). Returns the record and its total length. Applies the
/// kernel's length checks with `inode_size` = `s_inode_size`.
pub fn decode(buf: &[u8], inode_size: usize) -> Result<(Tlv<'_>, usize), FcError> {
    if buf.len() < TL_LEN {
        return Err(FcError::Truncated {
            need: TL_LEN,
            have: buf.len(),
        });
    }
    let tag = le16(buf, 0);
    let len = le16(buf, 2) as usize;
    let avail = buf.len() - TL_LEN;
    if len > avail {
        return Err(FcError::Truncated {
            need: TL_LEN + len,
            have: buf.len(),
        });
    }
    if tag == TAG_DATA_CSUM {
        if len != DATA_CSUM_LEN {
            return Err(FcError::BadLength { tag, len });
        }
        let v = &buf[TL_LEN..TL_LEN + len];
        let tlv = Tlv::DataCsum {
            ino: le32(v, 0),
            lblk: le32(v, 4),
            len: le32(v, 8),
            pblk: le32(v, 12) as u64 | (le32(v, 16) as u64) << 32,
            crc: le32(v, 20),
        };
        return Ok((tlv, TL_LEN + len));
    }
    if tag == TAG_DATA_CHAIN {
        if len != 0 {
            return Err(FcError::BadLength { tag, len });
        }
        return Ok((Tlv::DataChain, TL_LEN));
    }
    if !value_len_valid(tag, len, inode_size) {
        return Err(if (TAG_ADD_RANGE..=TAG_HEAD).contains(&tag) {
            FcError::BadLength { tag, len }
        } else {
            FcError::UnknownTag(tag)
        });
    }
    let v = &buf[TL_LEN..TL_LEN + len];
    let dentry = || Dentry {
        parent: le32(v, 0),
        ino: le32(v, 4),
        name: Cow::Borrowed(&v[DENTRY_FIXED_LEN..]),
    };
    let tlv = match tag {
        TAG_HEAD => Tlv::Head {
            features: le32(v, 0),
            tid: le32(v, 4),
        },
        TAG_ADD_RANGE => {
            let (elen, unwritten) = decode_len(le16(v, 8));
            Tlv::AddRange {
                ino: le32(v, 0),
                lblk: le32(v, 4),
                len: elen,
                pblk: (le16(v, 10) as u64) << 32 | le32(v, 12) as u64,
                unwritten,
            }
        }
        TAG_DEL_RANGE => Tlv::DelRange {
            ino: le32(v, 0),
            lblk: le32(v, 4),
            len: le32(v, 8),
        },
        TAG_CREAT => Tlv::Creat(dentry()),
        TAG_LINK => Tlv::Link(dentry()),
        TAG_UNLINK => Tlv::Unlink(dentry()),
        TAG_INODE => Tlv::Inode {
            ino: le32(v, 0),
            raw: Cow::Borrowed(&v[INODE_FIXED_LEN..]),
        },
        TAG_PAD => Tlv::Pad { len: len as u16 },
        TAG_TAIL => Tlv::Tail {
            tid: le32(v, 0),
            crc: le32(v, 4),
            len: len as u16,
        },
        _ => return Err(FcError::UnknownTag(tag)),
    };
    Ok((tlv, TL_LEN + len))
}

/// Fast-commit CRC update: raw CRC32C, register starting at 0 for each fast commit
/// (§9.5; not `~0`, not the file-system seed).
pub fn crc_update(crc: u32, bytes: &[u8]) -> u32 {
    crc32c_raw(crc, bytes)
}

// -------------------------------------------------------------------------------------
// Packer (writer side, §9.4)
// -------------------------------------------------------------------------------------

/// Lays out one fast commit in whole blocks exactly like the kernel (§9.4 steps 2–6):
/// an optional HEAD, the records in push order, a PAD closing a block whenever the
/// next record would not leave room for a 4-byte PAD header, and a TAIL that fills
/// its block with zeros after `fc_crc`. The commit always starts at a block boundary.
///
/// ```text
/// let mut p = FcPacker::new(bs, running_tid, first_since_full_commit)?;
/// p.push(&Tlv::Inode { ino, raw: Cow::Borrowed(raw) })?;   // TooLarge => full commit
/// let fc = p.finish();                  // fc.blocks.len() == fc.nblocks * bs
/// ```
#[derive(Debug, Clone)]
pub struct FcPacker {
    bs: usize,
    tid: u32,
    /// Whole blocks; the last one is being filled.
    buf: Vec<u8>,
    /// Offset of the next free byte in the last block.
    off: usize,
    /// CRC of every closed block of this commit.
    crc: u32,
}

/// A packed fast commit: the blocks to write at consecutive fast-commit-area blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedCommit {
    /// `nblocks * block_size` bytes.
    pub blocks: Vec<u8>,
    pub nblocks: usize,
    pub tid: u32,
    /// The CRC stored in the TAIL.
    pub crc: u32,
}

impl FcPacker {
    /// Start a fast commit for the running transaction `tid`. `head`: this is the
    /// first fast commit since the last full commit (the kernel's `s_fc_bytes == 0`),
    /// so it begins with `HEAD {features 0, tid}`.
    pub fn new(block_size: usize, tid: u32, head: bool) -> Result<FcPacker, FcError> {
        // The smallest JBD2 block is 1 KiB; anything below a TAIL plus a PAD header
        // cannot hold a commit at all.
        if block_size < 64 || block_size > u16::MAX as usize + 1 {
            return Err(FcError::Invalid("unsupported fast-commit block size"));
        }
        let mut p = FcPacker {
            bs: block_size,
            tid,
            buf: vec![0u8; block_size],
            off: 0,
            crc: 0,
        };
        if head {
            p.push_any(&Tlv::Head {
                features: SUPPORTED_FEATURES,
                tid,
            })?;
        }
        Ok(p)
    }

    /// The largest value a single record may have in this block size (a record must
    /// leave room for a PAD header in an empty block).
    pub fn max_value_len(block_size: usize) -> usize {
        block_size.saturating_sub(2 * TL_LEN)
    }

    /// Append a record. HEAD and TAIL are placed by the packer itself and are
    /// rejected; a record that can never fit a block gives [`FcError::TooLarge`]
    /// (the kernel then falls back to a full commit). On error nothing changes.
    pub fn push(&mut self, tlv: &Tlv<'_>) -> Result<(), FcError> {
        if matches!(tlv, Tlv::Head { .. } | Tlv::Tail { .. }) {
            return Err(FcError::Invalid("HEAD and TAIL are added by the packer"));
        }
        self.push_any(tlv)
    }

    fn push_any(&mut self, tlv: &Tlv<'_>) -> Result<(), FcError> {
        tlv.validate()?;
        let total = tlv.total_len();
        let at = self.reserve(total)?;
        let end = self.buf.len() - self.bs + at;
        tlv.encode(&mut self.buf[end..end + total])?;
        Ok(())
    }

    /// The kernel's `ext4_fc_reserve_space`: place `total` bytes in the current block
    /// if that leaves room for a PAD header, else close the block with a PAD and use
    /// the start of a new one. Returns the offset inside the (new) last block.
    fn reserve(&mut self, total: usize) -> Result<usize, FcError> {
        if total > self.bs - TL_LEN {
            return Err(FcError::TooLarge {
                total,
                block_size: self.bs,
            });
        }
        let remaining = self.bs - TL_LEN - self.off;
        if total <= remaining {
            let at = self.off;
            self.off += total;
            return Ok(at);
        }
        let base = self.buf.len() - self.bs;
        let pad_at = base + self.off;
        put_le16(&mut self.buf, pad_at, TAG_PAD);
        put_le16(&mut self.buf, pad_at + 2, remaining as u16);
        // The value bytes are still zero (blocks start zeroed, nothing wrote there).
        self.crc = crc_update(self.crc, &self.buf[base..]);
        self.buf.resize(self.buf.len() + self.bs, 0);
        self.off = total;
        Ok(0)
    }

    /// Blocks used so far (the TAIL may still add one).
    pub fn blocks_used(&self) -> usize {
        self.buf.len() / self.bs
    }

    /// Blocks the commit will occupy once finished (TAIL included).
    pub fn blocks_when_finished(&self) -> usize {
        let tail = TL_LEN + TAIL_LEN;
        self.blocks_used() + usize::from(tail > self.bs - TL_LEN - self.off)
    }

    /// Append the TAIL (tid, CRC over everything up to and including `fc_tid`) filling
    /// its block, and return the blocks.
    pub fn finish(self) -> PackedCommit {
        self.finish_with(false)
    }

    /// Like [`Self::finish`], for a commit that ends in the last block of the
    /// fast-commit area: a short TAIL (value 8 bytes) followed by a *stopper*, a
    /// second TAIL whose tid is not the commit's, filling the block. Both
    /// replayers keep asking for the next block after a valid TAIL and fail reading
    /// past the area (ext4-format.md §9.6); the stopper ends the scan (and the
    /// replay pass) inside the last block instead, as a successful stop.
    pub fn finish_stopped(self) -> PackedCommit {
        self.finish_with(true)
    }

    fn finish_with(mut self, stopper: bool) -> PackedCommit {
        let tail_total = TL_LEN + TAIL_LEN;
        let reserve = if stopper { 2 * tail_total } else { tail_total };
        // Two 12-byte records always fit a block of at least 64 bytes.
        let at = self.reserve(reserve).unwrap_or(0);
        let base = self.buf.len() - self.bs;
        let p = base + at;
        let fc_len = if stopper {
            TAIL_LEN
        } else {
            self.bs - at - TL_LEN
        };
        if stopper {
            let q = p + tail_total;
            let stop_len = self.bs - at - tail_total - TL_LEN;
            put_le16(&mut self.buf, q, TAG_TAIL);
            put_le16(&mut self.buf, q + 2, stop_len as u16);
            put_le32(&mut self.buf, q + 4, !self.tid);
            put_le32(&mut self.buf, q + 8, 0);
        }
        put_le16(&mut self.buf, p, TAG_TAIL);
        put_le16(&mut self.buf, p + 2, fc_len as u16);
        put_le32(&mut self.buf, p + 4, self.tid);
        let crc = crc_update(self.crc, &self.buf[base..p + TAIL_CRC_SPAN]);
        put_le32(&mut self.buf, p + 8, crc);
        // Bytes after fc_crc were never written: they are zero.
        let nblocks = self.buf.len() / self.bs;
        PackedCommit {
            blocks: self.buf,
            nblocks,
            tid: self.tid,
            crc,
        }
    }
}

// -------------------------------------------------------------------------------------
// Scanner (recovery side, §9.6)
// -------------------------------------------------------------------------------------

/// Why a scan stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanEnd {
    /// Block 0 does not start with a HEAD: nothing to replay.
    NoHead,
    /// A HEAD of another transaction: the area is stale from here on.
    StaleHead { tid: u32 },
    /// A HEAD announcing features we do not know (kernel: `-EOPNOTSUPP`).
    UnsupportedFeatures(u32),
    /// A record failed the length or tag checks (unknown tag, value past the block).
    BadRecord {
        block: u32,
        offset: usize,
        error: FcError,
    },
    /// A TAIL whose tid or CRC does not match: the end of the valid log (or a torn
    /// commit).
    BadTail { block: u32, tid: u32, crc_ok: bool },
    /// Blocks were fed out of order (kernel: `-EFSCORRUPTED`).
    OutOfOrder { expected: u32, got: u32 },
    /// The area ran out while the scan still wanted blocks. The kernel would then
    /// read past the journal and fail recovery (§9.6).
    AreaExhausted,
}

/// Result of scanning a fast-commit area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FcScan {
    /// Every record up to and including the last valid TAIL, in log order (HEAD, PAD
    /// and TAIL included, as the kernel counts them). This is what replay applies.
    pub tags: Vec<Tlv<'static>>,
    /// Physical ranges `(pblk, len)` named by the ADD_RANGE records in `tags`: the
    /// replay allocator must not hand them out (§9.6). `len` may be 0.
    pub in_use: Vec<(u64, u32)>,
    /// Number of valid fast commits (valid TAILs).
    pub commits: u32,
    /// Blocks read.
    pub blocks_scanned: u32,
    pub end: ScanEnd,
}

impl FcScan {
    /// Whether the kernel's scan would have failed recovery here (§9.6): an error
    /// before any valid TAIL, unsupported HEAD features, blocks out of order, or a
    /// scan that ran off the area. Stale or absent HEADs are not errors.
    pub fn kernel_error(&self) -> bool {
        match &self.end {
            ScanEnd::NoHead | ScanEnd::StaleHead { .. } => false,
            ScanEnd::UnsupportedFeatures(_)
            | ScanEnd::OutOfOrder { .. }
            | ScanEnd::AreaExhausted => true,
            ScanEnd::BadRecord { .. } | ScanEnd::BadTail { .. } => self.commits == 0,
        }
    }

    /// Records that change the file system (no HEAD, PAD, TAIL, DATA_CSUM).
    pub fn replayable(&self) -> impl Iterator<Item = &Tlv<'static>> {
        self.tags.iter().filter(|t| {
            !matches!(
                t,
                Tlv::Head { .. }
                    | Tlv::Pad { .. }
                    | Tlv::Tail { .. }
                    | Tlv::DataCsum { .. }
                    | Tlv::DataChain
            )
        })
    }

    /// `tags` index ranges of the valid commits, in log order.
    fn commit_spans(&self) -> Vec<std::ops::Range<usize>> {
        let mut spans = Vec::new();
        let mut s = 0;
        for (i, t) in self.tags.iter().enumerate() {
            if matches!(t, Tlv::Tail { .. }) {
                spans.push(s..i + 1);
                s = i + 1;
            }
        }
        spans
    }

    /// The commits (indices from 0) whose DATA_CSUM records recovery verifies:
    /// the last valid commit and, for as long as a commit of the group carries
    /// DATA_CHAIN, the one before it. Any commit before the group was followed
    /// by one written after its flush completed, which proves its data durable
    /// (docs/FORMAT.md, fc_data_csum).
    pub fn final_group(&self) -> std::ops::Range<u32> {
        let spans = self.commit_spans();
        let mut first = spans.len();
        while first > 0 {
            first -= 1;
            let chained = self.tags[spans[first].clone()]
                .iter()
                .any(|t| matches!(t, Tlv::DataChain));
            if !chained {
                break;
            }
        }
        first as u32..spans.len() as u32
    }

    /// DATA_CSUM records `(pblk, len, crc)` of valid commit `k` (from 0).
    pub fn commit_data_csums(&self, k: u32) -> Vec<(u64, u32, u32)> {
        let spans = self.commit_spans();
        let Some(span) = spans.get(k as usize) else {
            return Vec::new();
        };
        self.tags[span.clone()]
            .iter()
            .filter_map(|t| match t {
                Tlv::DataCsum { pblk, len, crc, .. } => Some((*pblk, *len, *crc)),
                _ => None,
            })
            .collect()
    }

    /// Keep only the first `k` valid commits (a later one's data did not all
    /// reach the disk, so no fsync that wrote it or a commit after it returned).
    /// Recomputes [`Self::in_use`].
    pub fn truncate_commits(&mut self, k: u32) {
        if k >= self.commits {
            return;
        }
        let end = match k {
            0 => 0,
            k => self.commit_spans()[k as usize - 1].end,
        };
        self.tags.truncate(end);
        self.commits = k;
        self.in_use = self
            .tags
            .iter()
            .filter_map(|t| match t {
                Tlv::AddRange { pblk, len, .. } => Some((*pblk, *len)),
                _ => None,
            })
            .collect();
    }
}

/// Streaming scanner: feed fast-commit-area blocks 0, 1, 2, … until [`Self::feed`]
/// returns `false`, then [`Self::finish`].
#[derive(Debug, Clone)]
pub struct FcScanner {
    inode_size: usize,
    expected_tid: u32,
    next_off: u32,
    crc: u32,
    /// Records since the last valid TAIL.
    pending: Vec<Tlv<'static>>,
    pending_ranges: Vec<(u64, u32)>,
    scan: FcScan,
    done: bool,
    /// Accept commitfs's DATA_CSUM records (the image has
    /// `INCOMPAT_COMMITFS_FC_DATA_CSUM`); otherwise they end the scan like any tag
    /// the kernel does not know.
    data_csum: bool,
}

impl FcScanner {
    /// `inode_size` = `s_inode_size` (bounds INODE records); `expected_tid` = the
    /// first tid the JBD2 scan found not committed (`end_transaction`, §8.12).
    pub fn new(inode_size: usize, expected_tid: u32) -> FcScanner {
        FcScanner {
            inode_size,
            expected_tid,
            next_off: 0,
            crc: 0,
            pending: Vec::new(),
            pending_ranges: Vec::new(),
            scan: FcScan {
                tags: Vec::new(),
                in_use: Vec::new(),
                commits: 0,
                blocks_scanned: 0,
                end: ScanEnd::AreaExhausted,
            },
            done: false,
            data_csum: false,
        }
    }

    /// Accept DATA_CSUM records (see [`TAG_DATA_CSUM`]).
    pub fn with_data_csum(mut self, on: bool) -> FcScanner {
        self.data_csum = on;
        self
    }

    fn stop(&mut self, end: ScanEnd) -> bool {
        self.scan.end = end;
        self.done = true;
        false
    }

    /// Process fast-commit-area block `off` (0-based). Returns whether the scan wants
    /// the next block.
    pub fn feed(&mut self, off: u32, block: &[u8]) -> bool {
        if self.done {
            return false;
        }
        if self.next_off == 0 && (block.len() < TL_LEN || le16(block, 0) != TAG_HEAD) {
            return self.stop(ScanEnd::NoHead);
        }
        if off != self.next_off {
            let expected = self.next_off;
            return self.stop(ScanEnd::OutOfOrder { expected, got: off });
        }
        self.next_off += 1;
        self.scan.blocks_scanned += 1;
        let mut cur = 0usize;
        while block.len() - cur >= TL_LEN {
            let (tlv, total) = match decode(&block[cur..], self.inode_size) {
                Ok(x) => x,
                Err(error) => {
                    return self.stop(ScanEnd::BadRecord {
                        block: off,
                        offset: cur,
                        error,
                    })
                }
            };
            let bytes = &block[cur..cur + total];
            if matches!(tlv, Tlv::DataCsum { .. } | Tlv::DataChain) && !self.data_csum {
                return self.stop(ScanEnd::BadRecord {
                    block: off,
                    offset: cur,
                    error: FcError::UnknownTag(tlv.tag()),
                });
            }
            match tlv {
                Tlv::Head { features, tid } => {
                    if features & !SUPPORTED_FEATURES != 0 {
                        return self.stop(ScanEnd::UnsupportedFeatures(features));
                    }
                    if tid != self.expected_tid {
                        return self.stop(ScanEnd::StaleHead { tid });
                    }
                    self.crc = crc_update(self.crc, bytes);
                    self.pending.push(tlv.into_owned());
                }
                Tlv::Tail { tid, crc, .. } => {
                    self.crc = crc_update(self.crc, &bytes[..TAIL_CRC_SPAN]);
                    let crc_ok = crc == self.crc;
                    self.crc = 0;
                    if tid != self.expected_tid || !crc_ok {
                        return self.stop(ScanEnd::BadTail {
                            block: off,
                            tid,
                            crc_ok,
                        });
                    }
                    self.pending.push(tlv.into_owned());
                    self.scan.tags.append(&mut self.pending);
                    self.scan.in_use.append(&mut self.pending_ranges);
                    self.scan.commits += 1;
                }
                other => {
                    if let Tlv::AddRange { pblk, len, .. } = other {
                        self.pending_ranges.push((pblk, len));
                    }
                    self.crc = crc_update(self.crc, bytes);
                    self.pending.push(other.into_owned());
                }
            }
            cur += total;
        }
        true
    }

    /// The result; if the scan still wanted blocks, it ends with
    /// [`ScanEnd::AreaExhausted`].
    pub fn finish(self) -> FcScan {
        self.scan
    }
}

/// Scan fast-commit-area blocks given in order from block 0 (§9.6).
pub fn scan_blocks<'b>(
    blocks: impl IntoIterator<Item = &'b [u8]>,
    inode_size: usize,
    expected_tid: u32,
) -> FcScan {
    let mut s = FcScanner::new(inode_size, expected_tid);
    for (i, b) in blocks.into_iter().enumerate() {
        if !s.feed(i as u32, b) {
            break;
        }
    }
    s.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ISZ: usize = 256;

    fn raw_inode(seed: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| seed.wrapping_add(i as u8)).collect()
    }

    fn samples() -> Vec<Tlv<'static>> {
        vec![
            Tlv::AddRange {
                ino: 12,
                lblk: 7,
                len: 32768,
                pblk: 0x1_2345_6789,
                unwritten: false,
            },
            Tlv::AddRange {
                ino: 13,
                lblk: 0,
                len: 32767,
                pblk: 99,
                unwritten: true,
            },
            Tlv::DelRange {
                ino: 14,
                lblk: 3,
                len: u32::MAX,
            },
            Tlv::Creat(Dentry {
                parent: 2,
                ino: 15,
                name: Cow::Owned(b"a".to_vec()),
            }),
            Tlv::Link(Dentry {
                parent: 11,
                ino: 15,
                name: Cow::Owned(vec![b'x'; 255]),
            }),
            Tlv::Unlink(Dentry {
                parent: 2,
                ino: 16,
                name: Cow::Owned(b"gone".to_vec()),
            }),
            Tlv::Inode {
                ino: 15,
                raw: Cow::Owned(raw_inode(3, 160)),
            },
            Tlv::Pad { len: 9 },
            Tlv::Head {
                features: 0,
                tid: 77,
            },
            Tlv::Tail {
                tid: 77,
                crc: 0xDEAD_BEEF,
                len: 20,
            },
        ]
    }

    #[test]
    fn every_record_round_trips() {
        for t in samples() {
            let mut buf = vec![0xAAu8; t.total_len() + 3];
            let n = t.encode(&mut buf).unwrap();
            assert_eq!(n, t.total_len());
            let (d, used) = decode(&buf[..n], ISZ).unwrap();
            assert_eq!(used, n);
            assert_eq!(d, t);
            assert_eq!(d.tag(), le16(&buf, 0));
            assert_eq!(le16(&buf, 2) as usize, t.value_len());
        }
    }

    #[test]
    fn kernel_length_rules() {
        assert!(value_len_valid(TAG_ADD_RANGE, 16, ISZ));
        assert!(!value_len_valid(TAG_ADD_RANGE, 15, ISZ));
        assert!(!value_len_valid(TAG_DEL_RANGE, 16, ISZ));
        assert!(!value_len_valid(TAG_CREAT, 8, ISZ), "empty name");
        assert!(value_len_valid(TAG_LINK, 8 + 255, ISZ));
        assert!(!value_len_valid(TAG_UNLINK, 8 + 256, ISZ));
        assert!(!value_len_valid(TAG_INODE, 4 + 127, ISZ));
        assert!(value_len_valid(TAG_INODE, 4 + 256, ISZ));
        assert!(!value_len_valid(TAG_INODE, 4 + 257, ISZ));
        assert!(value_len_valid(TAG_PAD, 0, ISZ));
        assert!(!value_len_valid(TAG_TAIL, 7, ISZ));
        assert!(!value_len_valid(TAG_HEAD, 9, ISZ));
        assert!(!value_len_valid(0, 0, ISZ));
        assert!(!value_len_valid(10, 4, ISZ));
        // A value running past the block.
        let mut b = [0u8; 20];
        put_le16(&mut b, 0, TAG_PAD);
        put_le16(&mut b, 2, 17);
        assert!(matches!(decode(&b, ISZ), Err(FcError::Truncated { .. })));
        put_le16(&mut b, 2, 16);
        assert_eq!(decode(&b, ISZ).unwrap().1, 20);
        put_le16(&mut b, 0, 0x0A);
        assert_eq!(decode(&b, ISZ), Err(FcError::UnknownTag(0x0A)));
    }

    #[test]
    fn encode_rejects_what_the_kernel_would_not_write() {
        let bad = [
            Tlv::AddRange {
                ino: 1,
                lblk: 0,
                len: 0,
                pblk: 1,
                unwritten: false,
            },
            Tlv::AddRange {
                ino: 1,
                lblk: 0,
                len: 32768,
                pblk: 1,
                unwritten: true,
            },
            Tlv::AddRange {
                ino: 1,
                lblk: 0,
                len: 2,
                pblk: PBLK_LIMIT - 1,
                unwritten: false,
            },
            Tlv::Creat(Dentry {
                parent: 2,
                ino: 3,
                name: Cow::Borrowed(b""),
            }),
            Tlv::Inode {
                ino: 3,
                raw: Cow::Owned(vec![0; 100]),
            },
        ];
        for t in bad {
            assert!(t.encode(&mut [0u8; 512]).is_err(), "{t:?}");
        }
        let t = Tlv::DelRange {
            ino: 1,
            lblk: 0,
            len: 1,
        };
        assert!(matches!(
            t.encode(&mut [0u8; 10]),
            Err(FcError::Truncated { .. })
        ));
    }

    /// Independent CRC per §9.5: every byte from the commit's first byte up to the
    /// end of the TAIL's `fc_tid`, register starting at 0.
    fn reference_crc(blocks: &[u8], bs: usize) -> u32 {
        let last = blocks.len() - bs;
        let mut p = 0usize;
        loop {
            let (t, n) = decode(&blocks[last + p..], ISZ).unwrap();
            if let Tlv::Tail { .. } = t {
                return crc32c_raw(0, &blocks[..last + p + 8]);
            }
            p += n;
        }
    }

    #[test]
    fn packer_lays_out_like_the_kernel() {
        for bs in [1024usize, 4096] {
            let mut p = FcPacker::new(bs, 41, true).unwrap();
            let mut pushed = Vec::new();
            for i in 0..80u32 {
                let t = if i % 3 == 0 {
                    Tlv::Inode {
                        ino: 20 + i,
                        raw: Cow::Owned(raw_inode(i as u8, 160)),
                    }
                } else if i % 3 == 1 {
                    Tlv::AddRange {
                        ino: 20 + i,
                        lblk: i,
                        len: i + 1,
                        pblk: 1000 + i as u64,
                        unwritten: i % 2 == 0,
                    }
                } else {
                    Tlv::Link(Dentry {
                        parent: 2,
                        ino: 20 + i,
                        name: Cow::Owned(vec![b'n'; 1 + (i as usize * 7) % 200]),
                    })
                };
                p.push(&t).unwrap();
                pushed.push(t);
            }
            let expect_blocks = p.blocks_when_finished();
            let fc = p.finish();
            assert_eq!(fc.nblocks, expect_blocks);
            assert_eq!(fc.blocks.len(), fc.nblocks * bs);
            assert!(fc.nblocks > 1, "must have needed PADs");
            assert_eq!(fc.crc, reference_crc(&fc.blocks, bs));
            // Walk every block: covered exactly by TLVs, PAD/TAIL last, each record
            // leaves room for a PAD header, zeros after fc_crc.
            let mut got = Vec::new();
            for b in 0..fc.nblocks {
                let blk = &fc.blocks[b * bs..(b + 1) * bs];
                let mut cur = 0;
                let mut last_tag = 0;
                while cur < bs {
                    let (t, n) = decode(&blk[cur..], ISZ).unwrap();
                    if !matches!(t, Tlv::Pad { .. } | Tlv::Tail { .. }) {
                        assert!(cur + n <= bs - TL_LEN, "record leaves room for a PAD");
                    }
                    last_tag = t.tag();
                    if let Tlv::Tail { tid, crc, len } = t {
                        assert_eq!(tid, 41);
                        assert_eq!(crc, fc.crc);
                        assert_eq!(cur + 4 + len as usize, bs);
                        assert!(blk[cur + 12..].iter().all(|&x| x == 0));
                    }
                    if let Tlv::Pad { .. } = t {
                        assert!(blk[cur + 4..cur + n].iter().all(|&x| x == 0));
                    }
                    got.push(t.into_owned());
                    cur += n;
                }
                assert_eq!(cur, bs);
                let want = if b + 1 == fc.nblocks {
                    TAG_TAIL
                } else {
                    TAG_PAD
                };
                assert_eq!(last_tag, want);
            }
            assert_eq!(
                got[0],
                Tlv::Head {
                    features: 0,
                    tid: 41
                }
            );
            let records: Vec<_> = got
                .into_iter()
                .filter(|t| !matches!(t, Tlv::Head { .. } | Tlv::Pad { .. } | Tlv::Tail { .. }))
                .collect();
            assert_eq!(records, pushed);
        }
    }

    #[test]
    fn packer_places_pad_exactly_at_the_kernel_threshold() {
        let bs = 1024;
        // HEAD (12 bytes) + a 1008-byte PAD-free record fills to bs - 4 exactly.
        let mut p = FcPacker::new(bs, 1, true).unwrap();
        let inode = Tlv::Inode {
            ino: 12,
            raw: Cow::Owned(vec![1; bs - 4 - 12 - 4 - 4]),
        };
        p.push(&inode).unwrap();
        assert_eq!(p.blocks_used(), 1);
        assert_eq!(p.off, bs - 4);
        // Even a PAD of 0 bytes closes the block; the tail goes to block 2.
        let fc = p.finish();
        assert_eq!(fc.nblocks, 2);
        assert_eq!(le16(&fc.blocks, bs - 4), TAG_PAD);
        assert_eq!(le16(&fc.blocks, bs - 2), 0);
        assert_eq!(le16(&fc.blocks, bs), TAG_TAIL);
        assert_eq!(fc.crc, reference_crc(&fc.blocks, bs));
        // One byte more can never fit.
        let mut p = FcPacker::new(bs, 1, false).unwrap();
        let big = Tlv::Inode {
            ino: 12,
            raw: Cow::Owned(vec![1; bs - 4 - 4 - 4 + 1]),
        };
        assert!(matches!(p.push(&big), Err(FcError::TooLarge { .. })));
        assert_eq!(p.blocks_used(), 1);
        assert_eq!(p.off, 0, "a refused record leaves the packer untouched");
        let just = Tlv::Inode {
            ino: 12,
            raw: Cow::Owned(vec![1; bs - 4 - 4 - 4]),
        };
        p.push(&just).unwrap();
        assert!(p
            .push(&Tlv::Head {
                features: 0,
                tid: 1
            })
            .is_err());
    }

    #[test]
    fn no_head_without_request_and_empty_commit_is_one_block() {
        let fc = FcPacker::new(4096, 9, false).unwrap().finish();
        assert_eq!(fc.nblocks, 1);
        assert_eq!(le16(&fc.blocks, 0), TAG_TAIL);
        assert_eq!(le16(&fc.blocks, 2) as usize, 4096 - 4);
        assert_eq!(fc.crc, crc32c_raw(0, &fc.blocks[..8]));
    }

    /// An area with several commits of tid `tid`, the first with a HEAD.
    fn area(bs: usize, tid: u32, commits: &[Vec<Tlv<'static>>]) -> (Vec<u8>, Vec<Tlv<'static>>) {
        let mut out = Vec::new();
        let mut all = Vec::new();
        for (i, c) in commits.iter().enumerate() {
            let mut p = FcPacker::new(bs, tid, i == 0).unwrap();
            for t in c {
                p.push(t).unwrap();
            }
            let fc = p.finish();
            let mut at = 0;
            while at < fc.blocks.len() {
                let (t, n) = decode(&fc.blocks[at..], ISZ).unwrap();
                all.push(t.into_owned());
                at += n;
            }
            out.extend_from_slice(&fc.blocks);
        }
        (out, all)
    }

    fn some_commits(n: usize, tag: u32) -> Vec<Vec<Tlv<'static>>> {
        (0..n)
            .map(|c| {
                (0..(3 + c * 5))
                    .map(|i| match i % 4 {
                        0 => Tlv::AddRange {
                            ino: tag + i as u32,
                            lblk: i as u32,
                            len: 4,
                            pblk: 5000 + (c * 100 + i) as u64,
                            unwritten: false,
                        },
                        1 => Tlv::DelRange {
                            ino: tag,
                            lblk: 10,
                            len: 2,
                        },
                        2 => Tlv::Unlink(Dentry {
                            parent: 2,
                            ino: tag,
                            name: Cow::Owned(format!("n{c}-{i}").into_bytes()),
                        }),
                        _ => Tlv::Inode {
                            ino: tag,
                            raw: Cow::Owned(raw_inode(c as u8, 160)),
                        },
                    })
                    .collect()
            })
            .collect()
    }

    fn blocks(a: &[u8], bs: usize) -> Vec<&[u8]> {
        a.chunks(bs).collect()
    }

    /// Chained fast commits (`fc_data_csum`): the final group runs back from
    /// the last commit through every commit that carries DATA_CHAIN; a kernel
    /// scan (no data_csum) stops at the record; truncation keeps a prefix.
    #[test]
    fn data_chain_marks_the_final_group() {
        let csum = |k: u32| Tlv::DataCsum {
            ino: 12,
            lblk: k,
            len: 1,
            pblk: 700 + k as u64,
            crc: 0xabc0 + k,
        };
        // Commits 0..5: 2 and 4 carry DATA_CHAIN (3 does not): group = 3..5.
        let commits: Vec<Vec<Tlv<'static>>> = (0..5u32)
            .map(|k| {
                let mut c = vec![csum(k)];
                if k == 2 || k == 4 {
                    c.push(Tlv::DataChain);
                }
                c
            })
            .collect();
        let (a, _) = area(4096, 8, &commits);
        let mut s = FcScanner::new(ISZ, 8).with_data_csum(true);
        for (i, b) in blocks(&a, 4096).into_iter().enumerate() {
            s.feed(i as u32, b);
        }
        let mut s = s.finish();
        assert_eq!(s.commits, 5);
        assert_eq!(s.final_group(), 3..5);
        assert_eq!(s.commit_data_csums(4), vec![(704, 1, 0xabc4)]);
        assert_eq!(s.commit_data_csums(3), vec![(703, 1, 0xabc3)]);
        assert!(s.commit_data_csums(5).is_empty());
        assert!(!s.replayable().any(|t| matches!(t, Tlv::DataChain)));
        // Dropping from commit 3 on leaves commits 0..3, whose last one chains
        // to commit 1.
        s.truncate_commits(3);
        assert_eq!(s.commits, 3);
        assert_eq!(s.final_group(), 1..3);
        assert_eq!(
            s.tags
                .iter()
                .filter(|t| matches!(t, Tlv::Tail { .. }))
                .count(),
            3
        );
        s.truncate_commits(0);
        assert!(s.tags.is_empty() && s.in_use.is_empty());
        assert_eq!(s.final_group(), 0..0);
        // Without the data_csum incompat bit the record ends the scan.
        let k = scan_blocks(blocks(&a, 4096), ISZ, 8);
        assert_eq!(k.commits, 0);
        // A DATA_CHAIN with a value is corrupt.
        let mut buf = [0u8; 8];
        put_le16(&mut buf, 0, TAG_DATA_CHAIN);
        put_le16(&mut buf, 2, 4);
        assert!(decode(&buf, ISZ).is_err());
        put_le16(&mut buf, 2, 0);
        assert_eq!(decode(&buf, ISZ).unwrap(), (Tlv::DataChain, 4));
    }

    #[test]
    fn scanner_accepts_what_the_packer_writes() {
        for bs in [1024usize, 4096] {
            let commits = some_commits(4, 20);
            let (a, all) = area(bs, 8, &commits);
            // Plus trailing garbage-free zero blocks (an unused area).
            let mut with_tail = a.clone();
            with_tail.extend(std::iter::repeat_n(0u8, 3 * bs));
            let s = scan_blocks(blocks(&with_tail, bs), ISZ, 8);
            assert_eq!(s.commits, 4);
            assert_eq!(s.tags, all);
            assert!(!s.kernel_error());
            assert!(matches!(s.end, ScanEnd::BadRecord { .. }), "{:?}", s.end);
            let ranges: Vec<_> = commits
                .iter()
                .flatten()
                .filter_map(|t| match t {
                    Tlv::AddRange { pblk, len, .. } => Some((*pblk, *len)),
                    _ => None,
                })
                .collect();
            assert_eq!(s.in_use, ranges);
            assert_eq!(s.replayable().count(), commits.iter().map(Vec::len).sum());
            // The area exactly full: the scan wants more.
            let s = scan_blocks(blocks(&a, bs), ISZ, 8);
            assert_eq!(s.commits, 4);
            assert_eq!(s.end, ScanEnd::AreaExhausted);
            assert!(s.kernel_error());
        }
    }

    #[test]
    fn wrong_tid_or_crc_replays_nothing() {
        let bs = 1024;
        let (a, _) = area(bs, 8, &some_commits(2, 30));
        let s = scan_blocks(blocks(&a, bs), ISZ, 9);
        assert_eq!(s.end, ScanEnd::StaleHead { tid: 8 });
        assert!(s.tags.is_empty() && s.in_use.is_empty());
        assert!(!s.kernel_error());
        // A flipped byte anywhere in the first commit's CRC span: nothing replays.
        // The first commit is one block; its TAIL ends the CRC span.
        let tail_at = {
            let mut at = 0;
            loop {
                let (t, n) = decode(&a[at..bs], ISZ).unwrap();
                if let Tlv::Tail { .. } = t {
                    break at;
                }
                at += n;
            }
        };
        // Bytes after fc_crc are not covered: flipping one changes nothing.
        let mut b = a.clone();
        b[tail_at + 20] ^= 0x40;
        assert_eq!(scan_blocks(blocks(&b, bs), ISZ, 8).commits, 2);
        for pos in [13usize, tail_at - 3, tail_at + 5] {
            let mut b = a.clone();
            b[pos] ^= 0x40;
            let s = scan_blocks(blocks(&b, bs), ISZ, 8);
            assert_eq!(s.commits, 0, "flip at {pos}: {:?}", s.end);
            assert!(s.tags.is_empty());
            assert!(s.kernel_error());
        }
        // Block 0 not starting with HEAD.
        let mut b = a.clone();
        put_le16(&mut b, 0, TAG_PAD);
        assert_eq!(scan_blocks(blocks(&b, bs), ISZ, 8).end, ScanEnd::NoHead);
        // Unsupported HEAD features.
        let mut b = a.clone();
        put_le32(&mut b, 4, 1);
        let s = scan_blocks(blocks(&b, bs), ISZ, 8);
        assert_eq!(s.end, ScanEnd::UnsupportedFeatures(1));
        assert!(s.kernel_error());
    }

    #[test]
    fn stale_blocks_after_the_last_valid_tail_are_ignored() {
        let bs = 1024;
        // An old, longer run of tid 5 ...
        let (old, _) = area(bs, 5, &some_commits(4, 40));
        // ... then a full commit of 5 and one fast commit of tid 6 over block 0.
        let (new, new_tags) = area(bs, 6, &some_commits(1, 50));
        let mut disk = old.clone();
        disk[..new.len()].copy_from_slice(&new);
        assert!(old.len() > new.len() + bs);
        let s = scan_blocks(blocks(&disk, bs), ISZ, 6);
        assert_eq!(s.commits, 1);
        assert_eq!(s.tags, new_tags);
        assert!(!s.kernel_error(), "stale remainder ends the scan quietly");
        assert!(
            matches!(
                s.end,
                ScanEnd::BadTail { tid: 5, .. } | ScanEnd::BadRecord { .. }
            ),
            "{:?}",
            s.end
        );
        // A torn second commit (its blocks still the stale ones): only the first.
        let (two, two_tags) = area(bs, 6, &some_commits(2, 60));
        let (one, _) = area(bs, 6, &some_commits(1, 60));
        let mut torn = old.clone();
        torn[..one.len()].copy_from_slice(&two[..one.len()]);
        let s = scan_blocks(blocks(&torn, bs), ISZ, 6);
        assert_eq!(s.commits, 1);
        let first: Vec<_> = two_tags
            .iter()
            .take_while(|t| !matches!(t, Tlv::Tail { .. }))
            .cloned()
            .chain(
                two_tags
                    .iter()
                    .find(|t| matches!(t, Tlv::Tail { .. }))
                    .cloned(),
            )
            .collect();
        assert_eq!(s.tags, first);
        let _ = two;
    }

    #[test]
    fn out_of_order_blocks_are_an_error() {
        let bs = 1024;
        let (a, _) = area(bs, 3, &some_commits(3, 70));
        let mut s = FcScanner::new(ISZ, 3);
        assert!(s.feed(0, &a[..bs]));
        assert!(!s.feed(2, &a[2 * bs..3 * bs]));
        assert_eq!(
            s.finish().end,
            ScanEnd::OutOfOrder {
                expected: 1,
                got: 2
            }
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

        #[test]
        fn random_bytes_never_panic(
            data in proptest::collection::vec(any::<u8>(), 0..3000),
            head in any::<bool>(),
            tid in 0u32..4,
            isz in prop_oneof![Just(128usize), Just(256), Just(1024)],
        ) {
            let mut data = data;
            if head && data.len() >= 12 {
                put_le16(&mut data, 0, TAG_HEAD);
                put_le16(&mut data, 2, 8);
                put_le32(&mut data, 4, 0);
                put_le32(&mut data, 8, tid);
            }
            let s = scan_blocks(data.chunks(1024), isz, 1);
            prop_assert!(s.tags.len() >= s.commits as usize);
            let mut at = 0;
            while at < data.len() {
                match decode(&data[at..], isz) {
                    Ok((_, n)) => at += n,
                    Err(_) => break,
                }
            }
        }

        #[test]
        fn mutated_areas_never_panic_and_only_shrink(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            ncommits in 1usize..4,
        ) {
            let bs = 1024;
            let (a, all) = area(bs, 11, &some_commits(ncommits, 80));
            let mut b = a.clone();
            for (i, v) in &flips {
                let p = i.index(b.len());
                b[p] = *v;
            }
            let s = scan_blocks(b.chunks(bs), ISZ, 11);
            prop_assert!(s.commits as usize <= ncommits);
            if b == a {
                prop_assert_eq!(&s.tags, &all);
            }
            // Whatever is accepted re-encodes to exactly what the scan read.
            for t in &s.tags {
                let mut buf = vec![0u8; t.total_len()];
                if !matches!(t, Tlv::AddRange { len: 0, .. }) {
                    if let Ok(n) = t.encode(&mut buf) {
                        let (d, m) = decode(&buf, ISZ).unwrap();
                        prop_assert_eq!(m, n);
                        prop_assert_eq!(&d, t);
                    }
                }
            }
        }

        #[test]
        fn packer_output_always_scans_back(
            sizes in proptest::collection::vec(1usize..400, 0..30),
            bs in prop_oneof![Just(1024usize), Just(2048), Just(4096)],
        ) {
            let mut p = FcPacker::new(bs, 5, true).unwrap();
            let mut n = 0;
            for (i, s) in sizes.iter().enumerate() {
                let t = if *s > NAME_MAX {
                    Tlv::Inode { ino: i as u32, raw: Cow::Owned(vec![7; 128 + s % 128]) }
                } else {
                    Tlv::Creat(Dentry { parent: 2, ino: i as u32, name: Cow::Owned(vec![b'q'; *s]) })
                };
                p.push(&t).unwrap();
                n += 1;
            }
            let fc = p.finish();
            let s = scan_blocks(fc.blocks.chunks(bs), ISZ, 5);
            prop_assert_eq!(s.commits, 1);
            prop_assert_eq!(s.replayable().count(), n);
            prop_assert_eq!(s.end, ScanEnd::AreaExhausted);
        }
    }
}
