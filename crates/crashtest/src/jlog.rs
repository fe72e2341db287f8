//! Finding JBD2 log blocks in a recorded device log (ext4-format.md §8), for tests
//! that damage a live log or drop a commit block on purpose; and what the
//! fast-commit area of a crash image holds (§9.6), as recovery would scan it.

use commitfs_device::{BlockDevice, CrashLog, DeviceError, IoCategory, IoStats, LogOp};
use commitfs_format::csum::CsumCtx;
use commitfs_format::extent::NodeRef;
use commitfs_format::fast_commit::FcScan;
use commitfs_format::group_desc::GroupDesc;
use commitfs_format::jbd2::{self, JournalSuperblock};
use commitfs_format::jbd2_log::{self, LogFormat};
use commitfs_format::superblock::{self as sbf, Superblock};
use commitfs_journal::JournalMap;

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

/// What recovery of a crash image finds in its fast-commit area: the JBD2
/// recovery's end tid (the tid fast commits must carry) and the scan of the area
/// with that tid (§9.6). `None` when nothing would be scanned: no `fast_commit`
/// feature, an empty log (`s_start == 0`: the kernel runs no recovery at all), or
/// the JBD2 FAST_COMMIT bit clear on disk. On an image with commitfs's
/// `fc_data_csum` incompat bit, DATA_CSUM records are understood and a last commit
/// whose data does not match them is dropped, as commitfs's recovery does (the
/// kernel refuses such an image whatever its log holds).
pub fn fast_commit_scan(img: &[u8]) -> Result<Option<(u32, FcScan)>, String> {
    let sb = Superblock::parse(img.get(1024..2048).ok_or("image too small")?)
        .map_err(|e| format!("superblock: {e}"))?;
    if !sb.has_compat(sbf::COMPAT_HAS_JOURNAL) || !sb.has_compat(sbf::COMPAT_FAST_COMMIT) {
        return Ok(None);
    }
    let bs = sb.block_size();
    let map = journal_map(img, &sb)?;
    let dev = SliceDevice {
        img,
        stats: IoStats::default(),
    };
    // An image mounted with fc_data_csum carries DATA_CSUM records, and recovery
    // drops a last commit whose data does not match them (as the mount does); its
    // last JBD2 transaction may be a single-flush commit, verified the same way.
    let data_csum = sb.has_incompat(sbf::INCOMPAT_COMMITFS_FC_DATA_CSUM);
    let opts = commitfs_journal::RecoverOptions {
        verify_last: data_csum,
        inode_size: sb.inode_size() as usize,
    };
    let (jsb, report) = commitfs_journal::scan_with(&dev, &map, bs, true, opts)
        .map_err(|e| format!("JBD2 scan: {e}"))?;
    if !report.needed {
        return Ok(None);
    }
    let scan = commitfs_journal::read_fast_commits_with(
        &dev,
        &map,
        bs,
        &jsb,
        sb.inode_size() as usize,
        report.end_tid,
        data_csum,
    )
    .map_err(|e| format!("fast-commit scan: {e}"))?;
    Ok(scan.map(|s| (report.end_tid, s)))
}

/// What JBD2 recovery of a crash image replays (the tid run `start_tid..end_tid`),
/// scanned as commitfs's recovery scans it (`fc_data_csum` images verify their
/// last transaction). `None` when the image has no journal or an empty log.
pub fn jbd2_report(img: &[u8]) -> Result<Option<commitfs_journal::RecoveryReport>, String> {
    let sb = Superblock::parse(img.get(1024..2048).ok_or("image too small")?)
        .map_err(|e| format!("superblock: {e}"))?;
    if !sb.has_compat(sbf::COMPAT_HAS_JOURNAL) {
        return Ok(None);
    }
    let bs = sb.block_size();
    let map = journal_map(img, &sb)?;
    let dev = SliceDevice {
        img,
        stats: IoStats::default(),
    };
    let opts = commitfs_journal::RecoverOptions {
        verify_last: sb.has_incompat(sbf::INCOMPAT_COMMITFS_FC_DATA_CSUM),
        inode_size: sb.inode_size() as usize,
    };
    let (_, report) =
        commitfs_journal::scan_with(&dev, &map, bs, sb.has_compat(sbf::COMPAT_FAST_COMMIT), opts)
            .map_err(|e| format!("JBD2 scan: {e}"))?;
    Ok(report.needed.then_some(report))
}

/// Whether the image carries commitfs's `fc_data_csum` incompat bit (mounted
/// with `-o fc_data_csum` when it crashed).
pub fn has_fc_data_csum(img: &[u8]) -> bool {
    img.get(1024..2048)
        .and_then(|b| Superblock::parse(b).ok())
        .is_some_and(|sb| sb.has_incompat(sbf::INCOMPAT_COMMITFS_FC_DATA_CSUM))
}

/// Device runs of the journal inode, from its on-disk inode (extent tree of any
/// depth).
fn journal_map(img: &[u8], sb: &Superblock) -> Result<JournalMap, String> {
    let bs = sb.block_size();
    let ino = sb.journal_inum();
    if ino == 0 {
        return Err("external journals are not supported".into());
    }
    let ipg = sb.inodes_per_group();
    let (grp, idx) = ((ino - 1) / ipg, ((ino - 1) % ipg) as usize);
    let ds = sb.desc_size();
    let o = (sb.first_data_block() as usize + 1) * bs + grp as usize * ds;
    let gd = GroupDesc::parse(
        img.get(o..o + ds).ok_or("descriptor beyond the image")?,
        grp,
        0,
    )
    .map_err(|e| format!("group descriptor {grp}: {e}"))?;
    let io = gd.inode_table as usize * bs + idx * sb.inode_size() as usize;
    let i_block = img
        .get(io + 0x28..io + 0x64)
        .ok_or("journal inode beyond the image")?;
    let root = NodeRef::parse_root(i_block, ino).map_err(|e| format!("journal inode: {e}"))?;
    let mut runs = Vec::new();
    let mut stack = vec![(root.depth(), i_block.to_vec(), true)];
    while let Some((depth, raw, is_root)) = stack.pop() {
        let node = if is_root {
            NodeRef::parse_root(&raw, ino)
        } else {
            NodeRef::parse_block(
                &raw,
                0,
                Some(depth),
                &CsumCtx {
                    enabled: false,
                    fs_seed: 0,
                },
                ino,
                0,
            )
        }
        .map_err(|e| format!("journal extent tree: {e}"))?;
        runs.extend(node.extents().map(|e| (e.lblk, e.pblk, e.len)));
        for x in node.indexes() {
            let b = x.child as usize * bs;
            let blk = img
                .get(b..b + bs)
                .ok_or("journal tree block beyond the image")?;
            stack.push((depth - 1, blk.to_vec(), false));
        }
    }
    JournalMap::new(runs).map_err(|e| format!("journal map: {e}"))
}

/// A read-only device over an image in memory (no copy).
struct SliceDevice<'a> {
    img: &'a [u8],
    stats: IoStats,
}

impl BlockDevice for SliceDevice<'_> {
    fn read_at(&self, offset: u64, buf: &mut [u8], _: IoCategory) -> commitfs_device::Result<()> {
        let o = offset as usize;
        let src = self
            .img
            .get(o..o + buf.len())
            .ok_or(DeviceError::OutOfRange {
                offset,
                len: buf.len(),
                size: self.img.len() as u64,
            })?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn write_at(&self, _: u64, _: &[u8], _: IoCategory, _: bool) -> commitfs_device::Result<()> {
        Err(DeviceError::ReadOnly)
    }
    fn flush(&self) -> commitfs_device::Result<()> {
        Ok(())
    }
    fn size(&self) -> u64 {
        self.img.len() as u64
    }
    fn is_read_only(&self) -> bool {
        true
    }
    fn stats(&self) -> &IoStats {
        &self.stats
    }
}
