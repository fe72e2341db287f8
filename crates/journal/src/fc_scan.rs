//! The fast-commit area at recovery (ext4-format.md §8.10, §8.12 step 8, §9.6, §9.9,
//! §9.11).
//!
//! The area is journal blocks `M − N + 1 … M − 1` (`M = s_maxlen`, `N = s_num_fc_blks`,
//! 256 when 0); it is considered only when the JBD2 FAST_COMMIT bit is set on disk.
//! Fast commits are replayed by the file system after the JBD2 replay ([`crate::recover`]),
//! with `expected_tid` = the first tid the JBD2 scan found not committed.
//!
//! Making the replay crash-safe and atomic, with the tools of the format itself:
//!
//! 1. [`hold_log_for_fast_commits`]: right after [`crate::recover`] (which marked the
//!    log empty), point the superblock at an empty live log of transaction `T` =
//!    `expected_tid`. A crash from here on makes recovery end at `T` again and replay
//!    the same fast commits over the same home state.
//! 2. The file system computes the replay in memory and hands the changed blocks to
//!    [`commit_fast_commit_replay`], which writes them as JBD2 transaction `T` (a full
//!    commit of `T` supersedes every fast commit tagged `T`, §9.9), zeroes the stale
//!    HEAD, then writes the blocks home. Before the commit block is durable nothing
//!    home has changed; after it, recovery replays `T` and ignores the fast commits.
//! 3. [`finish_fast_commit_recovery`]: mark the log empty with FAST_COMMIT cleared.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use commitfs_device::{BlockDevice, IoCategory};
use commitfs_format::bytes::put_be32;
use commitfs_format::fast_commit::{self, FcScan, FcScanner};
use commitfs_format::jbd2::{self, JournalSuperblock};
use commitfs_format::jbd2_log::{self, Tag, TAG_ESCAPE};

use crate::recovery::{log_end, log_format, read_superblock};
use crate::{JournalError, JournalMap, Result};

/// Where the fast-commit blocks are, in journal blocks (§8.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FcArea {
    /// Journal block of fast-commit block 0 (`j_fc_first = M − N + 1`).
    pub first: u32,
    /// Blocks the kernel writes (`N − 1`); the last is journal block `M − 1`.
    pub blocks: u32,
}

/// The fast-commit area of a journal whose on-disk FAST_COMMIT bit is set, else
/// `None` (both recoverers then ignore the area, §8.12).
pub fn fc_area(jsb: &JournalSuperblock) -> Option<FcArea> {
    if jsb.feature_incompat & jbd2::INCOMPAT_FAST_COMMIT == 0 {
        return None;
    }
    let n = jsb.fc_blocks(true);
    // The kernel refuses such a journal at mount (§8.1); nothing sensible to read.
    if n < 2 || jsb.maxlen <= n || jsb.maxlen - n <= jsb.first {
        return None;
    }
    Some(FcArea {
        first: jsb.maxlen - n + 1,
        blocks: n - 1,
    })
}

/// Read the fast-commit area and scan it (§9.6). `jsb` is the journal superblock as
/// it was before recovery (its FAST_COMMIT bit decides whether the area counts),
/// `expected_tid` the JBD2 recovery's end tid ([`crate::RecoveryReport::end_tid`]),
/// `inode_size` the file system's `s_inode_size`. `None` when the bit is not set.
pub fn read_fast_commits(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    jsb: &JournalSuperblock,
    inode_size: usize,
    expected_tid: u32,
) -> Result<Option<FcScan>> {
    read_fast_commits_with(dev, map, bs, jsb, inode_size, expected_tid, false)
}

/// [`read_fast_commits`] on an image with commitfs's `fc_data_csum` incompat bit
/// (`data_csum`): DATA_CSUM and DATA_CHAIN records are accepted, and the last
/// valid commit, with the commits chained before it (DATA_CHAIN: written before
/// the previous one's flush completed), is checked against its data: from the
/// first whose data does not match on, the commits are dropped — data and log
/// went out under flushes that never completed, so no fsync they cover
/// returned. Earlier commits need no check: a commit written after their flush
/// completed follows them.
pub fn read_fast_commits_with(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    jsb: &JournalSuperblock,
    inode_size: usize,
    expected_tid: u32,
    data_csum: bool,
) -> Result<Option<FcScan>> {
    let Some(area) = fc_area(jsb) else {
        return Ok(None);
    };
    let mut scanner = FcScanner::new(inode_size, expected_tid).with_data_csum(data_csum);
    let mut buf = vec![0u8; bs];
    for off in 0..area.blocks {
        let j = area.first + off;
        let p = map.require(j)?;
        dev.read_at(p * bs as u64, &mut buf, IoCategory::FastCommit)?;
        if !scanner.feed(off, &buf) {
            break;
        }
    }
    let mut scan = scanner.finish();
    if data_csum {
        // The last commit and those chained before it (DATA_CHAIN): the first
        // whose data does not match ends the log, with everything after it.
        'group: for k in scan.final_group() {
            for (pblk, len, want) in scan.commit_data_csums(k) {
                let got = data_range_crc(dev, bs, pblk, len)?;
                if got != Some(want) {
                    tracing::warn!(
                        "fast commit {} of tid {expected_tid}: data blocks {pblk}+{len} do not \
                         match their DATA_CSUM (crc {got:?}, logged {want:#010x}); its flush \
                         never completed, dropping it and the {} after it",
                        k + 1,
                        scan.commits - k - 1
                    );
                    scan.truncate_commits(k);
                    break 'group;
                }
            }
        }
    }
    Ok(Some(scan))
}

/// Whether the fast-commit area (FAST_COMMIT bit set in `jsb`) holds a valid fast
/// commit of `tid` (DATA_CSUM records understood; their data is not checked: the
/// commit's presence alone proves that everything before it was flushed).
pub(crate) fn fc_area_has_commit(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    jsb: &JournalSuperblock,
    inode_size: usize,
    tid: u32,
) -> Result<bool> {
    let Some(area) = fc_area(jsb) else {
        return Ok(false);
    };
    let mut scanner = FcScanner::new(inode_size.max(128), tid).with_data_csum(true);
    let mut buf = vec![0u8; bs];
    for off in 0..area.blocks {
        let Some(p) = map.phys(area.first + off) else {
            break;
        };
        dev.read_at(p * bs as u64, &mut buf, IoCategory::FastCommit)?;
        if !scanner.feed(off, &buf) {
            break;
        }
    }
    Ok(scanner.finish().commits > 0)
}

/// [`commitfs_format::fast_commit::data_crc`] of device blocks `pblk..pblk+len`;
/// `None` when the range is outside the device (a corrupt record: never matches).
pub fn data_range_crc(
    dev: &dyn BlockDevice,
    bs: usize,
    pblk: u64,
    len: u32,
) -> Result<Option<u32>> {
    let end = pblk
        .checked_add(len as u64)
        .and_then(|e| e.checked_mul(bs as u64));
    if end.is_none_or(|e| e > dev.size()) {
        return Ok(None);
    }
    let mut crc = fast_commit::DATA_CRC_SEED;
    // Sized to the range (at most 64 blocks at a time): fast commits name
    // a few blocks per range, and zeroing a 64-block buffer for each of them
    // cost more than the reads (a profile of varmail with `fc_data_csum`).
    let mut buf = vec![0u8; bs * (len as usize).min(64)];
    let mut b = pblk;
    let end_blk = pblk + len as u64;
    while b < end_blk {
        let n = ((end_blk - b) as usize).min(64);
        let chunk = &mut buf[..n * bs];
        dev.read_at(b * bs as u64, chunk, IoCategory::Data)?;
        crc = fast_commit::data_crc(crc, chunk);
        b += n as u64;
    }
    Ok(Some(crc))
}

fn write_jsb(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    raw: &mut [u8],
    has_csum: bool,
) -> Result<()> {
    if has_csum {
        let c = jbd2::compute_checksum(raw);
        put_be32(raw, jbd2::S_CHECKSUM, c);
    }
    let p0 = map
        .phys(0)
        .ok_or_else(|| JournalError::BadJournal("journal block 0 is not mapped".into()))?;
    dev.write_at(p0 * raw.len() as u64, raw, IoCategory::Journal, true)?;
    Ok(())
}

/// Point the journal superblock at an empty live log of transaction `tid` at
/// `s_first` (FUA). Called right after [`crate::recover`]: a crash before the
/// fast-commit replay is committed then repeats recovery, which finds no transaction,
/// ends at `tid`, and replays the same fast commits. (Stale blocks at `s_first` carry
/// older tids, or `tid` without a valid commit block.)
pub fn hold_log_for_fast_commits(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    tid: u32,
) -> Result<()> {
    let (jsb, mut raw) = read_superblock(dev, map, bs)?;
    put_be32(&mut raw, jbd2::S_START, jsb.first);
    put_be32(&mut raw, jbd2::S_SEQUENCE, tid);
    write_jsb(dev, map, &mut raw, jsb.has_csum_v2or3())
}

/// Write `blocks` (home block number → content) as JBD2 transaction `tid` at the
/// start of the log held by [`hold_log_for_fast_commits`], then zero fast-commit
/// block 0, then write the blocks home and flush. Write order: log blocks, flush,
/// commit block (FUA: the replay is durable and atomic), zeroed HEAD (FUA), home
/// blocks, flush. Returns `false`, having written nothing, when the transaction does
/// not fit in the log or names blocks the log format cannot address.
pub fn commit_fast_commit_replay(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    tid: u32,
    blocks: &BTreeMap<u64, Vec<u8>>,
) -> Result<bool> {
    let (jsb, _) = read_superblock(dev, map, bs)?;
    let f = log_format(&jsb, bs);
    let per = f.tags_per_descriptor().max(1);
    let needed = (blocks.len().div_ceil(per) + blocks.len() + 1) as u64;
    let last = log_end(&jsb, true);
    if blocks.is_empty()
        || jsb.first as u64 + needed > last as u64
        || (!f.is_64bit() && blocks.keys().any(|&b| b >> 32 != 0))
        || blocks.values().any(|d| d.len() != bs)
    {
        return Ok(false);
    }
    let list: Vec<(&u64, &Vec<u8>)> = blocks.iter().collect();
    let mut log: Vec<Vec<u8>> = Vec::with_capacity(needed as usize);
    for chunk in list.chunks(per) {
        let mut tags = Vec::with_capacity(chunk.len());
        let mut datas = Vec::with_capacity(chunk.len());
        for (&blocknr, data) in chunk {
            let mut copy = (*data).clone();
            let mut flags = 0;
            if jbd2_log::needs_escape(&copy) {
                copy[..4].fill(0);
                flags |= TAG_ESCAPE;
            }
            let checksum = if f.has_csum() {
                jbd2_log::data_checksum(&f, tid, &copy)
            } else {
                0
            };
            tags.push(Tag {
                blocknr,
                flags,
                checksum,
            });
            datas.push(copy);
        }
        log.push(jbd2_log::build_descriptor(&f, tid, &tags));
        log.extend(datas);
    }
    for (i, b) in log.iter().enumerate() {
        let j = jsb.first + i as u32;
        dev.write_at(map.require(j)? * bs as u64, b, IoCategory::Journal, false)?;
    }
    dev.flush()?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let commit = jbd2_log::build_commit(&f, tid, now.as_secs(), now.subsec_nanos());
    let cj = jsb.first + log.len() as u32;
    dev.write_at(
        map.require(cj)? * bs as u64,
        &commit,
        IoCategory::Journal,
        true,
    )?;
    // The fast commits are now superseded; without this, e2fsck 1.47 would refuse
    // the whole journal on their stale HEAD (§9.8).
    if let Some(area) = fc_area(&jsb) {
        let p = map.require(area.first)?;
        dev.write_at(p * bs as u64, &vec![0u8; bs], IoCategory::FastCommit, true)?;
    }
    for (&blocknr, data) in blocks {
        dev.write_at(blocknr * bs as u64, data, IoCategory::Metadata, false)?;
    }
    dev.flush()?;
    Ok(true)
}

/// End of recovery with fast commits (§8.11, §9.11 item 4): after the replayed state
/// is durable (this flushes first), mark the log empty with `s_sequence = next_tid`
/// and the FAST_COMMIT bit cleared (FUA), then zero fast-commit block 0 so that no
/// stale HEAD is left for e2fsck 1.47 to trip over once the bit is set again. The
/// order matters: while the log is live the fast-commit area must stay intact.
pub fn finish_fast_commit_recovery(
    dev: &dyn BlockDevice,
    map: &JournalMap,
    bs: usize,
    next_tid: u32,
) -> Result<()> {
    dev.flush()?;
    let (jsb, mut raw) = read_superblock(dev, map, bs)?;
    let area = fc_area(&jsb);
    put_be32(&mut raw, jbd2::S_START, 0);
    put_be32(&mut raw, jbd2::S_SEQUENCE, next_tid);
    put_be32(
        &mut raw,
        jbd2::S_FEATURE_INCOMPAT,
        jsb.feature_incompat & !jbd2::INCOMPAT_FAST_COMMIT,
    );
    write_jsb(dev, map, &mut raw, jsb.has_csum_v2or3())?;
    if let Some(area) = area {
        if let Some(p) = map.phys(area.first) {
            dev.write_at(p * bs as u64, &vec![0u8; bs], IoCategory::FastCommit, false)?;
            dev.flush()?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{recover, Journal, LogOptions};
    use commitfs_device::MemDevice;
    use commitfs_format::fast_commit::{FcPacker, ScanEnd, Tlv};
    use std::borrow::Cow;
    use std::sync::Arc;

    const BS: usize = 1024;
    const JSTART: u64 = 200;
    const JLEN: u32 = 128;
    const NFC: u32 = 16;

    fn fresh_device() -> Arc<MemDevice> {
        let dev = Arc::new(MemDevice::new(400 * BS));
        let mut sb = vec![0u8; BS];
        put_be32(&mut sb, jbd2::H_MAGIC, jbd2::JBD2_MAGIC);
        put_be32(&mut sb, jbd2::H_BLOCKTYPE, jbd2::BLOCKTYPE_SUPERBLOCK_V2);
        put_be32(&mut sb, jbd2::S_BLOCKSIZE, BS as u32);
        put_be32(&mut sb, jbd2::S_MAXLEN, JLEN);
        put_be32(&mut sb, jbd2::S_FIRST, 1);
        put_be32(&mut sb, jbd2::S_SEQUENCE, 1);
        put_be32(&mut sb, jbd2::S_NR_USERS, 1);
        put_be32(&mut sb, jbd2::S_NUM_FC_BLKS, NFC);
        sb[jbd2::S_UUID..jbd2::S_UUID + 16].copy_from_slice(&[9u8; 16]);
        dev.write_at(JSTART * BS as u64, &sb, IoCategory::Journal, false)
            .unwrap();
        dev
    }

    fn set_fc_bit(dev: &MemDevice, map: &JournalMap) {
        let (jsb, mut raw) = read_superblock(dev, map, BS).unwrap();
        put_be32(
            &mut raw,
            jbd2::S_FEATURE_INCOMPAT,
            jsb.feature_incompat | jbd2::INCOMPAT_FAST_COMMIT,
        );
        write_jsb(dev, map, &mut raw, jsb.has_csum_v2or3()).unwrap();
    }

    fn one_tx(j: &Journal, blk: u64, v: u8) {
        let h = j.start(1).unwrap();
        let b = j.bread(blk).unwrap();
        j.get_write_access(&h, &b).unwrap();
        b.data_mut().fill(v);
        j.dirty_metadata(&h, &b);
        j.stop(h).unwrap();
        j.commit().unwrap();
    }

    #[test]
    fn area_geometry_follows_the_kernel() {
        let dev = fresh_device();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let (jsb, _) = read_superblock(&*dev, &map, BS).unwrap();
        assert_eq!(fc_area(&jsb), None, "bit clear: area ignored");
        set_fc_bit(&dev, &map);
        let (jsb, _) = read_superblock(&*dev, &map, BS).unwrap();
        assert_eq!(
            fc_area(&jsb),
            Some(FcArea {
                first: JLEN - NFC + 1,
                blocks: NFC - 1
            })
        );
    }

    /// A committed transaction, then fast commits of the next tid in the area: the
    /// scan finds them with the recovery's end tid, and the finishing steps leave an
    /// empty log without the bit and a zeroed block 0.
    #[test]
    fn fast_commits_after_a_full_commit_are_found_and_retired() {
        let dev = fresh_device();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let opts = LogOptions {
            bit64: true,
            csum: true,
            fast_commit: true,
            ..Default::default()
        };
        let j = Journal::open_log(dev.clone(), BS, map.clone(), opts).unwrap();
        one_tx(&j, 30, 7);
        drop(j);
        set_fc_bit(&dev, &map);
        let (before, _) = read_superblock(&*dev, &map, BS).unwrap();
        assert_ne!(before.start, 0);
        // One committed transaction (tid s_sequence): fast commits carry the next.
        let mut p = FcPacker::new(BS, before.sequence.wrapping_add(1), true).unwrap();
        p.push(&Tlv::Inode {
            ino: 12,
            raw: Cow::Owned(vec![5u8; 160]),
        })
        .unwrap();
        let fc = p.finish();
        let area = fc_area(&before).unwrap();
        dev.write_at(
            map.phys(area.first).unwrap() * BS as u64,
            &fc.blocks,
            IoCategory::FastCommit,
            false,
        )
        .unwrap();

        let report = recover(&*dev, &map, BS, true).unwrap();
        let scan = read_fast_commits(&*dev, &map, BS, &before, 256, report.end_tid)
            .unwrap()
            .unwrap();
        assert_eq!(report.end_tid, fc.tid, "fast commit belongs to the end tid");
        assert_eq!(scan.commits, 1);
        assert_eq!(scan.replayable().count(), 1);
        assert!(!scan.kernel_error(), "{:?}", scan.end);
        // Another tid: a stale area.
        let stale = read_fast_commits(&*dev, &map, BS, &before, 256, report.end_tid + 1)
            .unwrap()
            .unwrap();
        assert_eq!(stale.end, ScanEnd::StaleHead { tid: fc.tid });

        // With live fast commits, recovery leaves the log held for the end tid
        // (no crash window before their replay); holding it again is idempotent.
        let after = read_superblock(&*dev, &map, BS).unwrap().0;
        assert_eq!((after.start, after.sequence), (after.first, report.end_tid));
        let t = report.end_tid;
        hold_log_for_fast_commits(&*dev, &map, BS, t).unwrap();
        let held = read_superblock(&*dev, &map, BS).unwrap().0;
        assert_eq!((held.start, held.sequence), (held.first, t));
        let r2 = recover(&*dev, &map, BS, true).unwrap();
        assert_eq!((r2.end_tid, r2.transactions), (t, 0), "an empty live log");
        hold_log_for_fast_commits(&*dev, &map, BS, t).unwrap();
        assert_eq!(
            read_fast_commits(&*dev, &map, BS, &held, 256, t)
                .unwrap()
                .unwrap()
                .commits,
            1,
            "still replayable after a repeated recovery"
        );

        // The replayed blocks, committed as transaction t: written home, and a crash
        // before the log is marked empty replays them and not the fast commits.
        let mut blocks = BTreeMap::new();
        blocks.insert(40u64, vec![0x5Au8; BS]);
        let mut magic = vec![1u8; BS];
        put_be32(&mut magic, 0, jbd2::JBD2_MAGIC);
        blocks.insert(41u64, magic.clone());
        assert!(commit_fast_commit_replay(&*dev, &map, BS, t, &blocks).unwrap());
        let img = dev.contents();
        assert_eq!(img[40 * BS], 0x5A);
        assert_eq!(&img[41 * BS..42 * BS], &magic[..]);
        let area = fc_area(&before).unwrap();
        let off = (JSTART + area.first as u64) as usize * BS;
        assert!(
            img[off..off + BS].iter().all(|&b| b == 0),
            "stale HEAD wiped"
        );
        let crashed = MemDevice::from_vec(img.clone());
        {
            let mut c = crashed.contents();
            c[40 * BS..41 * BS].fill(0);
            c[41 * BS..42 * BS].fill(0);
            let crashed = MemDevice::from_vec(c);
            let r3 = recover(&crashed, &map, BS, true).unwrap();
            assert_eq!((r3.end_tid, r3.blocks_replayed), (t + 1, 2));
            let c = crashed.contents();
            assert_eq!(c[40 * BS], 0x5A);
            assert_eq!(&c[41 * BS..42 * BS], &magic[..], "escaped block restored");
            let s = read_fast_commits(&crashed, &map, BS, &before, 256, r3.end_tid)
                .unwrap()
                .unwrap();
            assert_eq!(s.commits, 0, "superseded by the full commit of t");
        }
        // Too big for the log: nothing written.
        let huge: BTreeMap<u64, Vec<u8>> =
            (0..JLEN as u64).map(|b| (b + 300, vec![0; BS])).collect();
        assert!(!commit_fast_commit_replay(&*dev, &map, BS, t, &huge).unwrap());

        finish_fast_commit_recovery(&*dev, &map, BS, report.end_tid + 1).unwrap();
        let (done, _) = read_superblock(&*dev, &map, BS).unwrap();
        assert_eq!(done.start, 0);
        assert_eq!(done.sequence, report.end_tid + 1);
        assert_eq!(done.feature_incompat & jbd2::INCOMPAT_FAST_COMMIT, 0);
        assert!(read_fast_commits(&*dev, &map, BS, &done, 256, 0)
            .unwrap()
            .is_none());
        let img = dev.contents();
        let off = (JSTART + area.first as u64) as usize * BS;
        assert!(
            img[off..off + BS].iter().all(|&b| b == 0),
            "stale HEAD wiped"
        );
        assert!(!recover(&*dev, &map, BS, true).unwrap().needed);
        let _ = img;
    }
}
