//! Finding JBD2 log blocks in a recorded device log (ext4-format.md §8), for tests
//! that damage a live log or drop a commit block on purpose.

use commitfs_device::{CrashLog, IoCategory, LogOp};
use commitfs_format::jbd2::{self, JournalSuperblock};
use commitfs_format::jbd2_log::{self, LogFormat};

/// One journal block found in a journal-category write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogBlock {
    /// Index of the write in the device log.
    pub log_idx: usize,
    /// Byte offset of this block on the device.
    pub offset: u64,
    pub blocktype: u32,
    /// `h_sequence` (the transaction id; meaningless for the superblock).
    pub seq: u32,
    pub fua: bool,
    /// The block as written.
    pub data: Vec<u8>,
}

impl LogBlock {
    pub fn is_superblock(&self) -> bool {
        self.blocktype == jbd2::BLOCKTYPE_SUPERBLOCK_V1
            || self.blocktype == jbd2::BLOCKTYPE_SUPERBLOCK_V2
    }
}

/// Every block with a JBD2 header written to the journal in `log[..k]`. Logged
/// copies of metadata that begin with the magic are escaped (§8.6), so headers
/// are only descriptors, commits, revokes and the superblock.
pub fn journal_blocks(log: &CrashLog, bs: usize, k: usize) -> Vec<LogBlock> {
    let mut out = Vec::new();
    for (i, op) in log.ops()[..k.min(log.len())].iter().enumerate() {
        let LogOp::Write {
            offset,
            data,
            fua,
            cat: IoCategory::Journal,
        } = op
        else {
            continue;
        };
        for (n, b) in data.chunks(bs).enumerate() {
            if let Some((blocktype, seq)) = jbd2_log::parse_header(b) {
                out.push(LogBlock {
                    log_idx: i,
                    offset: offset + (n * bs) as u64,
                    blocktype,
                    seq,
                    fua: *fua,
                    data: b.to_vec(),
                });
            }
        }
    }
    out
}

/// The log format of the journal whose superblock is at byte `offset` of `img`.
pub fn log_format(img: &[u8], offset: u64, bs: usize) -> Result<LogFormat, String> {
    let o = offset as usize;
    let raw = img
        .get(o..o + bs)
        .ok_or_else(|| "journal superblock beyond the image".to_string())?;
    let jsb = JournalSuperblock::parse(raw, offset / bs as u64).map_err(|e| e.to_string())?;
    Ok(LogFormat {
        block_size: bs,
        incompat: jsb.feature_incompat,
        seed: commitfs_format::crc32c_raw(0xFFFF_FFFF, &jsb.uuid),
    })
}

/// Recompute the tail checksum of a descriptor or revoke block (CSUM_V2/V3,
/// §8.5): crc32c over the block with the tail zeroed.
pub fn reseal_tail(block: &mut [u8], f: &LogFormat) {
    let n = block.len() - 4;
    let c = commitfs_format::crc32c_raw(commitfs_format::crc32c_raw(f.seed, &block[..n]), &[0; 4]);
    block[n..].copy_from_slice(&c.to_be_bytes());
}

/// Home blocks logged by the descriptors of transaction `tid`.
pub fn logged_blocks(blocks: &[LogBlock], tid: u32, f: &LogFormat) -> Result<Vec<u64>, String> {
    let bs = f.block_size;
    let mut out = Vec::new();
    for b in blocks
        .iter()
        .filter(|b| b.seq == tid && b.blocktype == jbd2::BLOCKTYPE_DESCRIPTOR)
    {
        let tags = jbd2_log::parse_descriptor(&b.data, f, b.offset / bs as u64)
            .map_err(|e| e.to_string())?;
        out.extend(tags.iter().map(|t| t.blocknr));
    }
    Ok(out)
}
