//! JBD2 recovery: scan, revoke, replay (ext4-format.md §8.12).
//!
//! Works on the raw device through a [`JournalMap`], before the file system reads any
//! metadata. Replay is idempotent: it only copies logged blocks to their homes, so a
//! crash during replay followed by another recovery gives the same result (the
//! journal superblock is reset only after every home write is durable).

use std::collections::HashMap;

use commitfs_device::{BlockDevice, IoCategory};
use commitfs_format::bytes::put_be32;
use commitfs_format::jbd2::{
    self, JournalSuperblock, BLOCKTYPE_COMMIT, BLOCKTYPE_DESCRIPTOR, BLOCKTYPE_REVOKE,
};
use commitfs_format::jbd2_log::{self, LogFormat, TAG_ESCAPE};

use crate::{JournalError, JournalMap, Result};

/// What a recovery did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Whether the log held anything to replay.
    pub needed: bool,
    /// First and one-past-last replayed transaction ids.
    pub start_tid: u32,
    pub end_tid: u32,
    pub transactions: u32,
    pub blocks_replayed: u64,
    pub blocks_revoked: u64,
    /// Why the scan stopped, when it stopped early on a damaged transaction.
    pub stopped_at: Option<String>,
    /// Commit blocks accepted on their header alone (the rest of the block was
    /// torn), as the kernel accepts them ([`jbd2_log::Commit::header_ok`]).
    pub torn_commits: u32,
}

/// How to recover a journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecoverOptions {
    /// The image is in `fc_data_csum` mode (ext4 incompat bit
    /// `INCOMPAT_COMMITFS_FC_DATA_CSUM`): its last transaction may be a
    /// single-flush commit, accepted only when every tag checksum and every data
    /// range of its commit-block extension verify, or when a fast commit of the
    /// next tid follows it (docs/FORMAT.md, Extensions).
    pub verify_last: bool,
    /// `s_inode_size` (for scanning the fast-commit area).
    pub inode_size: usize,
}

/// tid comparison modulo 2^32 (§8.11).
pub(crate) fn tid_gt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}
pub(crate) fn tid_geq(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

pub(crate) struct LogReader<'a> {
    pub dev: &'a dyn BlockDevice,
    pub map: &'a JournalMap,
    pub bs: usize,
    pub first: u32,
    /// One past the last regular log block (`j_last`).
    pub last: u32,
}

impl LogReader<'_> {
    pub fn read(&self, jblk: u32, buf: &mut [u8]) -> Result<()> {
        let p = self.map.require(jblk)?;
        self.dev
            .read_at(p * self.bs as u64, buf, IoCategory::Journal)?;
        Ok(())
    }
    pub fn next(&self, jblk: u32) -> u32 {
        if jblk + 1 >= self.last {
            self.first
        } else {
            jblk + 1
        }
    }
}

/// The log format (features, seed) of a journal superblock.
pub(crate) fn log_format(jsb: &JournalSuperblock, bs: usize) -> LogFormat {
    LogFormat {
        block_size: bs,
        incompat: jsb.feature_incompat,
        seed: commitfs_format::crc32c_raw(0xFFFF_FFFF, &jsb.uuid),
    }
}

/// Read and validate the journal superblock (journal block 0).
pub fn read_superblock(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
) -> Result<(JournalSuperblock, Vec<u8>)> {
    let p = map
        .phys(0)
        .ok_or_else(|| JournalError::BadJournal("journal block 0 is not mapped".into()))?;
    let mut raw = vec![0u8; bs];
    dev.read_at(p * bs as u64, &mut raw, IoCategory::Journal)?;
    let jsb = JournalSuperblock::parse(&raw, p)?;
    if jsb.blocksize as usize != bs {
        return Err(JournalError::BadJournal(format!(
            "journal block size {} differs from the file system's {bs}",
            jsb.blocksize
        )));
    }
    if jsb.maxlen > map.len() {
        return Err(JournalError::BadJournal(format!(
            "journal claims {} blocks but its inode maps {}",
            jsb.maxlen,
            map.len()
        )));
    }
    let unknown = jsb.feature_incompat & !jbd2::KNOWN_INCOMPAT;
    if unknown != 0 {
        return Err(JournalError::BadJournal(format!(
            "unknown journal incompat features {:#x}",
            unknown
        )));
    }
    Ok((jsb, raw))
}

/// `j_last`: end of the regular log area (§8.10).
pub(crate) fn log_end(jsb: &JournalSuperblock, fs_fast_commit: bool) -> u32 {
    let fc = if jsb.feature_incompat & jbd2::INCOMPAT_FAST_COMMIT != 0 {
        jsb.fc_blocks(fs_fast_commit)
    } else {
        0
    };
    jsb.maxlen.saturating_sub(fc).max(jsb.first + 1)
}

/// PASS_SCAN (§8.12): walk the live log from `s_start` and return the first tid
/// that is not validly committed; records in `report` why the scan stopped early.
fn scan_log(
    rd: &LogReader<'_>,
    f: &LogFormat,
    jsb: &JournalSuperblock,
    report: &mut RecoveryReport,
    last_start: &mut Option<u32>,
) -> Result<u32> {
    let bs = rd.bs;
    let f = *f;
    let mut buf = vec![0u8; bs];
    let mut pos = jsb.start;
    let mut tid = jsb.sequence;
    let mut last_commit_time = 0u64;
    let mut need_check_commit_time = false;
    let mut steps: u64 = 0;
    let limit = jsb.maxlen as u64 * 2;
    let mut tx_start = pos;
    loop {
        steps += 1;
        if steps > limit {
            break;
        }
        rd.read(pos, &mut buf)?;
        let Some((btype, seq)) = jbd2_log::parse_header(&buf) else {
            break;
        };
        if seq != tid {
            break;
        }
        let here = pos;
        pos = rd.next(pos);
        match btype {
            BLOCKTYPE_DESCRIPTOR => {
                if !jbd2_log::verify_tail(&buf, &f) {
                    need_check_commit_time = true;
                }
                let tags = match jbd2_log::parse_descriptor(&buf, &f, here as u64) {
                    Ok(t) => t,
                    Err(e) => {
                        report.stopped_at = Some(e.to_string());
                        break;
                    }
                };
                for _ in &tags {
                    pos = rd.next(pos);
                }
            }
            BLOCKTYPE_REVOKE => {
                if !jbd2_log::verify_tail(&buf, &f) {
                    need_check_commit_time = true;
                }
            }
            BLOCKTYPE_COMMIT => {
                let Some(c) = jbd2_log::parse_commit(&buf, &f) else {
                    break;
                };
                if need_check_commit_time {
                    if c.sec >= last_commit_time {
                        report.stopped_at = Some(format!(
                            "transaction {tid}: a descriptor or revoke block failed its checksum"
                        ));
                    }
                    break;
                }
                if !c.checksum_ok && c.header_ok {
                    // The kernel's rule (recovery.c, "Find incomplete commit
                    // block"): the header sector is the commit.
                    tracing::info!(
                        "transaction {tid}: commit block torn after its header, accepted"
                    );
                    report.torn_commits += 1;
                } else if !c.checksum_ok {
                    if c.sec >= last_commit_time {
                        report.stopped_at =
                            Some(format!("transaction {tid}: commit block checksum mismatch"));
                    }
                    break;
                }
                last_commit_time = c.sec;
                *last_start = Some(tx_start);
                tx_start = pos;
                tid = tid.wrapping_add(1);
            }
            _ => break,
        }
    }
    Ok(tid)
}

/// Whether transaction `tid`, starting at log block `pos`, is complete: every
/// logged block matches its tag checksum (CSUM_V3) and every data range of a
/// single-flush commit-block extension matches its CRC32C.
fn verify_transaction(rd: &LogReader<'_>, f: &LogFormat, mut pos: u32, tid: u32) -> Result<bool> {
    let bs = rd.bs;
    let mut buf = vec![0u8; bs];
    let mut data = vec![0u8; bs];
    for _ in 0..rd.last as u64 + 1 {
        rd.read(pos, &mut buf)?;
        let Some((btype, seq)) = jbd2_log::parse_header(&buf) else {
            return Ok(false);
        };
        if seq != tid {
            return Ok(false);
        }
        let here = pos;
        pos = rd.next(pos);
        match btype {
            BLOCKTYPE_DESCRIPTOR => {
                let Ok(tags) = jbd2_log::parse_descriptor(&buf, f, here as u64) else {
                    return Ok(false);
                };
                for t in tags {
                    rd.read(pos, &mut data)?;
                    pos = rd.next(pos);
                    if f.csum_v3() && jbd2_log::data_checksum(f, tid, &data) != t.checksum {
                        return Ok(false);
                    }
                }
            }
            BLOCKTYPE_REVOKE => {}
            BLOCKTYPE_COMMIT => {
                for (pblk, len, crc) in jbd2_log::parse_commit_ext(&buf).unwrap_or_default() {
                    if crate::data_range_crc(rd.dev, bs, pblk, len)? != Some(crc) {
                        return Ok(false);
                    }
                }
                return Ok(true);
            }
            _ => return Ok(false),
        }
    }
    Ok(false)
}

/// The scan's end tid under `opts`: with `verify_last`, the last transaction
/// counts only if it verifies completely ([`verify_transaction`]) or a fast
/// commit of the next tid follows it in the fast-commit area (written after its
/// flush completed, so proving it durable). Otherwise the log ends before it:
/// its commit was single-flush and that flush never completed.
fn verified_end(
    rd: &LogReader<'_>,
    f: &LogFormat,
    jsb: &JournalSuperblock,
    end_tid: u32,
    last_start: Option<u32>,
    opts: RecoverOptions,
    report: &mut RecoveryReport,
) -> Result<u32> {
    let Some(start) = last_start.filter(|_| opts.verify_last) else {
        return Ok(end_tid);
    };
    let last = end_tid.wrapping_sub(1);
    if verify_transaction(rd, f, start, last)? {
        return Ok(end_tid);
    }
    if crate::fc_scan::fc_area_has_commit(rd.dev, rd.map, rd.bs, jsb, opts.inode_size, end_tid)? {
        return Ok(end_tid);
    }
    tracing::warn!(
        "transaction {last}: a logged block or data range does not match its checksum; \
         its single-flush commit never completed, dropping it"
    );
    report.stopped_at = Some(format!(
        "transaction {last}: incomplete single-flush commit dropped"
    ));
    Ok(last)
}

/// What is in a journal, without replaying anything (for `commitfs info`).
pub fn scan(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    fs_fast_commit: bool,
) -> Result<(JournalSuperblock, RecoveryReport)> {
    scan_with(dev, map, bs, fs_fast_commit, RecoverOptions::default())
}

/// [`scan`] with the rules of [`recover_with`].
pub fn scan_with(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    fs_fast_commit: bool,
    opts: RecoverOptions,
) -> Result<(JournalSuperblock, RecoveryReport)> {
    let (jsb, _) = read_superblock(dev, map, bs)?;
    let mut report = RecoveryReport::default();
    if jsb.start == 0 {
        return Ok((jsb, report));
    }
    report.needed = true;
    report.start_tid = jsb.sequence;
    let f = log_format(&jsb, bs);
    let rd = LogReader {
        dev,
        map,
        bs,
        first: jsb.first,
        last: log_end(&jsb, fs_fast_commit),
    };
    let mut last_start = None;
    let end = scan_log(&rd, &f, &jsb, &mut report, &mut last_start)?;
    let end = verified_end(&rd, &f, &jsb, end, last_start, opts, &mut report)?;
    report.end_tid = end;
    report.transactions = end.wrapping_sub(jsb.sequence);
    Ok((jsb, report))
}

/// Replay the journal if it holds committed transactions, then mark it empty.
/// `fs_fast_commit`: the ext4 superblock has the fast_commit feature.
pub fn recover(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    fs_fast_commit: bool,
) -> Result<RecoveryReport> {
    recover_with(dev, map, bs, fs_fast_commit, RecoverOptions::default())
}

/// [`recover`] with options (see [`RecoverOptions`]).
pub fn recover_with(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    fs_fast_commit: bool,
    opts: RecoverOptions,
) -> Result<RecoveryReport> {
    let (jsb, mut raw) = read_superblock(dev, map, bs)?;
    let mut report = RecoveryReport::default();
    if jsb.start == 0 {
        return Ok(report);
    }
    report.needed = true;
    let f = log_format(&jsb, bs);
    let rd = LogReader {
        dev,
        map,
        bs,
        first: jsb.first,
        last: log_end(&jsb, fs_fast_commit),
    };
    report.start_tid = jsb.sequence;

    let mut last_start = None;
    let end_tid = scan_log(&rd, &f, &jsb, &mut report, &mut last_start)?;
    let end_tid = verified_end(&rd, &f, &jsb, end_tid, last_start, opts, &mut report)?;
    let mut buf = vec![0u8; bs];
    report.end_tid = end_tid;
    report.transactions = end_tid.wrapping_sub(jsb.sequence);

    // PASS_REVOKE: highest revoking tid per block.
    let mut revoked: HashMap<u64, u32> = HashMap::new();
    let mut pos = jsb.start;
    let mut tid = jsb.sequence;
    while tid != end_tid {
        rd.read(pos, &mut buf)?;
        let Some((btype, _)) = jbd2_log::parse_header(&buf) else {
            break;
        };
        let here = pos;
        pos = rd.next(pos);
        match btype {
            BLOCKTYPE_DESCRIPTOR => {
                let n = jbd2_log::parse_descriptor(&buf, &f, here as u64)?.len();
                for _ in 0..n {
                    pos = rd.next(pos);
                }
            }
            BLOCKTYPE_REVOKE => {
                for b in jbd2_log::parse_revoke(&buf, &f, here as u64)? {
                    let e = revoked.entry(b).or_insert(tid);
                    if tid_gt(tid, *e) {
                        *e = tid;
                    }
                }
            }
            BLOCKTYPE_COMMIT => tid = tid.wrapping_add(1),
            _ => break,
        }
    }

    // PASS_REPLAY.
    let mut pos = jsb.start;
    let mut tid = jsb.sequence;
    let mut data = vec![0u8; bs];
    let mut bad_tags = 0u64;
    let total_blocks = dev.size() / bs as u64;
    while tid != end_tid {
        rd.read(pos, &mut buf)?;
        let Some((btype, _)) = jbd2_log::parse_header(&buf) else {
            break;
        };
        let here = pos;
        pos = rd.next(pos);
        match btype {
            BLOCKTYPE_DESCRIPTOR => {
                let tags = jbd2_log::parse_descriptor(&buf, &f, here as u64)?;
                for t in tags {
                    let dpos = pos;
                    pos = rd.next(pos);
                    if revoked.get(&t.blocknr).is_some_and(|&r| tid_geq(r, tid)) {
                        report.blocks_revoked += 1;
                        continue;
                    }
                    rd.read(dpos, &mut data)?;
                    if f.has_csum() && jbd2_log::data_checksum(&f, tid, &data) != t.checksum {
                        bad_tags += 1;
                        continue;
                    }
                    if t.blocknr >= total_blocks {
                        return Err(JournalError::BadJournal(format!(
                            "transaction {tid} logs block {} beyond the device",
                            t.blocknr
                        )));
                    }
                    if t.flags & TAG_ESCAPE != 0 {
                        put_be32(&mut data, 0, jbd2::JBD2_MAGIC);
                    }
                    dev.write_at(t.blocknr * bs as u64, &data, IoCategory::Metadata, false)?;
                    report.blocks_replayed += 1;
                }
            }
            BLOCKTYPE_COMMIT => tid = tid.wrapping_add(1),
            _ => {}
        }
    }
    dev.flush()?;
    if bad_tags > 0 {
        return Err(JournalError::BadJournal(format!(
            "{bad_tags} journaled blocks failed their checksums; replay incomplete"
        )));
    }
    // Only now that every home write is durable may the replayed transactions
    // leave the log. With live fast commits (FAST_COMMIT on disk) the log must stay
    // "live" and pointed at the first tid they belong to, or a crash before their
    // replay completes would lose them: s_start = s_first, s_sequence = end_tid
    // (the fast-commit replay then finishes and empties the log). Otherwise mark
    // it empty with the next tid past every one used (§8.11).
    if jsb.feature_incompat & jbd2::INCOMPAT_FAST_COMMIT != 0 {
        put_be32(&mut raw, jbd2::S_SEQUENCE, end_tid);
        put_be32(&mut raw, jbd2::S_START, jsb.first);
    } else {
        put_be32(&mut raw, jbd2::S_SEQUENCE, end_tid.wrapping_add(1));
        put_be32(&mut raw, jbd2::S_START, 0);
    }
    if jsb.has_csum_v2or3() {
        let c = jbd2::compute_checksum(&raw);
        put_be32(&mut raw, jbd2::S_CHECKSUM, c);
    }
    let p0 = map.phys(0).expect("checked in read_superblock");
    dev.write_at(p0 * bs as u64, &raw, IoCategory::Journal, true)?;
    Ok(report)
}
