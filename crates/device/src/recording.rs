//! A device that records every write and flush, for crash-consistency testing.
//!
//! [`RecordingDevice`] wraps a [`MemDevice`]: requests are served by it (so the file
//! system above sees an ordinary device) and each write (offset, bytes, FUA flag,
//! category) and flush is appended to an ordered log, under one mutex so the log
//! order is the order in which the device applied the requests, even with many
//! threads issuing I/O.
//!
//! [`CrashLog`] (taken with [`RecordingDevice::crash_log`]) builds the image a
//! power cut could leave after the first `k` requests of the log, following the
//! rules of a volatile write cache:
//!
//! * every write before the last flush preceding `k` is durable;
//! * every FUA write before `k` is durable;
//! * every other write before `k` (issued after that flush) may or may not have
//!   reached the media: each is included at random, and with `torn` each of its
//!   512-byte sectors is included at random (a write is not atomic).
//!
//! Included writes are applied in log order, so where two unflushed writes hit the
//! same block the result is either the later one, or the earlier one when the later
//! one is dropped; both are legal device behaviours. A device never lets an older
//! cached write overwrite a newer one, so that order is never produced.

use std::sync::Arc;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{BlockDevice, IoCategory, IoStats, MemDevice, Result};

/// Sector size of torn writes: a device persists at least whole sectors.
pub const SECTOR: usize = 512;

/// One request in the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogOp {
    Write {
        offset: u64,
        data: Arc<[u8]>,
        fua: bool,
        cat: IoCategory,
    },
    Flush,
}

impl LogOp {
    pub fn is_flush(&self) -> bool {
        matches!(self, LogOp::Flush)
    }
}

/// A [`MemDevice`] whose writes and flushes are logged in order (see the module
/// documentation).
pub struct RecordingDevice {
    dev: MemDevice,
    base: Arc<Vec<u8>>,
    log: Mutex<Vec<LogOp>>,
    /// Time a flush takes to be acknowledged after it was logged (a device's
    /// cache flush is slow; concurrent recordings need requests to overlap it).
    flush_latency: std::time::Duration,
    /// Time a write takes to complete after it was logged (the transfer:
    /// requests of other threads overlap it, as on a real device).
    write_latency: std::time::Duration,
}

impl RecordingDevice {
    /// Record on top of `image`; the image is also kept as the crash base.
    pub fn new(image: Vec<u8>) -> RecordingDevice {
        let base = Arc::new(image.clone());
        RecordingDevice {
            dev: MemDevice::from_vec(image),
            base,
            log: Mutex::new(Vec::new()),
            flush_latency: std::time::Duration::ZERO,
            write_latency: std::time::Duration::ZERO,
        }
    }

    /// Complete each write `d` after logging it (see [`Self::with_flush_latency`]).
    pub fn with_write_latency(mut self, d: std::time::Duration) -> RecordingDevice {
        self.write_latency = d;
        self
    }

    /// Acknowledge each flush `d` after logging it. Writes issued meanwhile are
    /// logged after the flush, so it does not cover them, as on a real device.
    pub fn with_flush_latency(mut self, d: std::time::Duration) -> RecordingDevice {
        self.flush_latency = d;
        self
    }

    /// Number of requests logged so far: the index the next request will get. A
    /// crash point `k` keeps (some of) requests `0..k`.
    pub fn op_count(&self) -> usize {
        self.log.lock().len()
    }

    /// A copy of the log so far.
    pub fn log(&self) -> Vec<LogOp> {
        self.log.lock().clone()
    }

    /// The current content (everything applied, as if nothing was lost).
    pub fn contents(&self) -> Vec<u8> {
        self.dev.contents()
    }

    /// Everything needed to build crash states of the I/O so far.
    pub fn crash_log(&self) -> CrashLog {
        CrashLog::new(self.base.clone(), self.log())
    }
}

impl BlockDevice for RecordingDevice {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> Result<()> {
        self.dev.read_at(offset, buf, cat)
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> Result<()> {
        // Apply and log under one lock: the log order is the order of application.
        let mut log = self.log.lock();
        self.dev.write_at(offset, buf, cat, fua)?;
        log.push(LogOp::Write {
            offset,
            data: Arc::from(buf),
            fua,
            cat,
        });
        drop(log);
        if !self.write_latency.is_zero() {
            std::thread::sleep(self.write_latency);
        }
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        {
            let mut log = self.log.lock();
            self.dev.flush()?;
            log.push(LogOp::Flush);
        }
        if !self.flush_latency.is_zero() {
            std::thread::sleep(self.flush_latency);
        }
        Ok(())
    }
    fn size(&self) -> u64 {
        self.dev.size()
    }
    fn is_read_only(&self) -> bool {
        self.dev.is_read_only()
    }
    fn stats(&self) -> &IoStats {
        self.dev.stats()
    }
}

impl MemDevice {
    /// The content, by value: a crash harness checks thousands of images and reuses
    /// one allocation for all of them instead of copying each out.
    pub fn into_vec(self) -> Vec<u8> {
        self.data.into_inner()
    }
}

/// How one write of the volatile tail is treated in a crash state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Durable,
    Dropped,
    /// Only the sectors whose bit is set (bit i = sector i, first 64 sectors; later
    /// sectors follow bit 63).
    Torn(u64),
}

/// How to choose the fate of writes after the last flush before the crash point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrashSpec {
    /// Crash after the first `k` requests of the log (`0..=len`).
    pub k: usize,
    /// Seed of the random choices.
    pub seed: u64,
    /// Probability that a volatile write (or sector) survives, in 1/256ths.
    pub keep_256: u8,
    /// Allow writes to be torn into 512-byte sectors.
    pub torn: bool,
}

/// A base image plus a log of requests, from which crash states are built.
#[derive(Clone)]
pub struct CrashLog {
    base: Arc<Vec<u8>>,
    ops: Arc<Vec<LogOp>>,
    /// `last_flush[k]`: index one past the last flush among requests `0..k` (0 if
    /// none); every write before it is durable at crash point `k`.
    last_flush: Vec<usize>,
    /// Byte ranges the device is assumed to write atomically: a write overlapping
    /// one is never torn (it survives whole or not at all).
    atomic: Vec<std::ops::Range<u64>>,
}

impl CrashLog {
    pub fn new(base: Arc<Vec<u8>>, ops: Vec<LogOp>) -> CrashLog {
        let mut last_flush = Vec::with_capacity(ops.len() + 1);
        let mut lf = 0;
        last_flush.push(0);
        for (i, op) in ops.iter().enumerate() {
            if op.is_flush() {
                lf = i + 1;
            }
            last_flush.push(lf);
        }
        CrashLog {
            base,
            ops: Arc::new(ops),
            last_flush,
            atomic: Vec::new(),
        }
    }

    /// Never tear writes that overlap `ranges` (e.g. a 1 KiB superblock whose
    /// checksum sits in its last sector: no file system survives tearing it).
    pub fn with_atomic(mut self, ranges: Vec<std::ops::Range<u64>>) -> CrashLog {
        self.atomic = ranges;
        self
    }

    fn tearable(&self, offset: u64, len: usize) -> bool {
        let end = offset + len as u64;
        !self.atomic.iter().any(|r| r.start < end && offset < r.end)
    }

    pub fn ops(&self) -> &[LogOp] {
        &self.ops
    }
    pub fn len(&self) -> usize {
        self.ops.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
    pub fn base(&self) -> &Arc<Vec<u8>> {
        &self.base
    }

    /// Index just past the last flush before crash point `k`.
    pub fn durable_prefix(&self, k: usize) -> usize {
        self.last_flush[k.min(self.ops.len())]
    }

    /// Indices of flushes: crash points `i + 1` are the flush boundaries.
    pub fn flush_indices(&self) -> Vec<usize> {
        self.ops
            .iter()
            .enumerate()
            .filter(|(_, o)| o.is_flush())
            .map(|(i, _)| i)
            .collect()
    }

    /// The fate of each write in `durable_prefix(k)..k`, in log order (flushes and
    /// FUA writes are always `Durable`).
    pub fn fates(&self, spec: &CrashSpec) -> Vec<Fate> {
        let k = spec.k.min(self.ops.len());
        let p = self.durable_prefix(k);
        let mut rng: StdRng = SeedableRng::seed_from_u64(spec.seed ^ (k as u64) << 20);
        let keep = |rng: &mut StdRng| rng.gen::<u8>() < spec.keep_256;
        self.ops[p..k]
            .iter()
            .map(|op| match op {
                LogOp::Flush => Fate::Durable,
                LogOp::Write { fua: true, .. } => Fate::Durable,
                LogOp::Write { data, offset, .. } => {
                    let sectors = data.len().div_ceil(SECTOR);
                    // A quarter of the torn-eligible writes tear; the others are whole.
                    if spec.torn
                        && sectors > 1
                        && rng.gen_ratio(1, 4)
                        && self.tearable(*offset, data.len())
                    {
                        let mut mask = 0u64;
                        for s in 0..sectors.min(64) {
                            if keep(&mut rng) {
                                mask |= 1 << s;
                            }
                        }
                        match mask {
                            0 => Fate::Dropped,
                            m if sectors <= 64 && m.count_ones() as usize == sectors => {
                                Fate::Durable
                            }
                            m => Fate::Torn(m),
                        }
                    } else if keep(&mut rng) {
                        Fate::Durable
                    } else {
                        Fate::Dropped
                    }
                }
            })
            .collect()
    }

    /// The image after a crash described by `spec`.
    pub fn image(&self, spec: &CrashSpec) -> Vec<u8> {
        let mut img = (*self.base).clone();
        let p = self.durable_prefix(spec.k);
        apply_range(&mut img, &self.ops[..p]);
        self.apply_tail(&mut img, spec);
        img
    }

    /// The image with every request `0..k` applied (no loss at all).
    pub fn full_image(&self, k: usize) -> Vec<u8> {
        let mut img = (*self.base).clone();
        apply_range(&mut img, &self.ops[..k.min(self.ops.len())]);
        img
    }

    /// The image of requests `0..k` for which `keep(index, op)` holds, applied in
    /// log order, ignoring the durability rules: for building deliberately broken
    /// states (a harness must prove that it notices them).
    pub fn image_filtered(&self, k: usize, mut keep: impl FnMut(usize, &LogOp) -> bool) -> Vec<u8> {
        let mut img = (*self.base).clone();
        for (i, op) in self.ops[..k.min(self.ops.len())].iter().enumerate() {
            if let LogOp::Write { offset, data, .. } = op {
                if keep(i, op) {
                    apply_write(&mut img, *offset, data);
                }
            }
        }
        img
    }

    /// Apply the volatile tail of `spec` to an image that holds exactly the durable
    /// prefix (see [`Materializer`]).
    fn apply_tail(&self, img: &mut [u8], spec: &CrashSpec) {
        let k = spec.k.min(self.ops.len());
        let p = self.durable_prefix(k);
        for (op, fate) in self.ops[p..k].iter().zip(self.fates(spec)) {
            let LogOp::Write { offset, data, .. } = op else {
                continue;
            };
            match fate {
                Fate::Durable => apply_write(img, *offset, data),
                Fate::Dropped => {}
                Fate::Torn(mask) => {
                    for (s, chunk) in data.chunks(SECTOR).enumerate() {
                        if mask & (1 << s.min(63)) != 0 {
                            apply_write(img, offset + (s * SECTOR) as u64, chunk);
                        }
                    }
                }
            }
        }
    }

    /// Is crash point `k` exactly a flush boundary (nothing volatile)?
    pub fn is_boundary(&self, k: usize) -> bool {
        let k = k.min(self.ops.len());
        self.ops[self.durable_prefix(k)..k]
            .iter()
            .all(|o| matches!(o, LogOp::Flush | LogOp::Write { fua: true, .. }))
    }
}

/// Builds many crash images cheaply: keeps the durable prefix of the last crash
/// point and advances it incrementally (crash points should come in ascending order).
pub struct Materializer {
    log: CrashLog,
    durable: Vec<u8>,
    upto: usize,
}

impl Materializer {
    pub fn new(log: CrashLog) -> Materializer {
        let durable = (*log.base).clone();
        Materializer {
            log,
            durable,
            upto: 0,
        }
    }

    /// The crash image of `spec`, written into `out` (reusing its allocation).
    pub fn image_into(&mut self, spec: &CrashSpec, out: &mut Vec<u8>) {
        let p = self.log.durable_prefix(spec.k);
        if p < self.upto {
            self.durable.copy_from_slice(&self.log.base);
            self.upto = 0;
        }
        apply_range(&mut self.durable, &self.log.ops[self.upto..p]);
        self.upto = p;
        out.clear();
        out.extend_from_slice(&self.durable);
        self.log.apply_tail(out, spec);
    }

    pub fn log(&self) -> &CrashLog {
        &self.log
    }
}

fn apply_range(img: &mut [u8], ops: &[LogOp]) {
    for op in ops {
        if let LogOp::Write { offset, data, .. } = op {
            apply_write(img, *offset, data);
        }
    }
}

fn apply_write(img: &mut [u8], offset: u64, data: &[u8]) {
    // The recording device validated the range when the write was made.
    let o = offset as usize;
    img[o..o + data.len()].copy_from_slice(data);
}

/// A small deterministic generator (SplitMix64) so the device crate needs no
/// random-number dependency.
#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 1024;

    fn w(d: &RecordingDevice, blk: usize, v: u8, fua: bool) {
        d.write_at((blk * BS) as u64, &[v; BS], IoCategory::Data, fua)
            .unwrap();
    }

    fn blk(img: &[u8], b: usize) -> &[u8] {
        &img[b * BS..(b + 1) * BS]
    }

    fn spec(k: usize, seed: u64, keep_256: u8, torn: bool) -> CrashSpec {
        CrashSpec {
            k,
            seed,
            keep_256,
            torn,
        }
    }

    #[test]
    fn logs_writes_and_flushes_in_order_and_serves_reads() {
        let d = RecordingDevice::new(vec![0; 16 * BS]);
        w(&d, 1, 1, false);
        d.flush().unwrap();
        w(&d, 2, 2, true);
        let mut b = [0u8; BS];
        d.read_at(BS as u64, &mut b, IoCategory::Data).unwrap();
        assert_eq!(b, [1; BS]);
        let log = d.log();
        assert_eq!(log.len(), 3);
        assert!(matches!(&log[0], LogOp::Write { offset, fua: false, .. } if *offset == BS as u64));
        assert!(log[1].is_flush());
        assert!(matches!(&log[2], LogOp::Write { fua: true, .. }));
        assert_eq!(d.op_count(), 3);
        assert_eq!(d.stats().snapshot().flushes, 1);
        // Out-of-range writes fail and are not logged.
        assert!(d
            .write_at((16 * BS) as u64, &[0; 1], IoCategory::Data, false)
            .is_err());
        assert_eq!(d.op_count(), 3);
    }

    #[test]
    fn flushed_and_fua_writes_survive_every_crash() {
        let d = RecordingDevice::new(vec![0; 16 * BS]);
        w(&d, 1, 1, false); // 0
        w(&d, 2, 2, false); // 1
        d.flush().unwrap(); // 2
        w(&d, 3, 3, false); // 3
        w(&d, 4, 4, true); // 4 (FUA)
        w(&d, 5, 5, false); // 5
        let cl = d.crash_log();
        assert_eq!(cl.durable_prefix(2), 0);
        assert_eq!(cl.durable_prefix(3), 3);
        assert_eq!(cl.durable_prefix(6), 3);
        assert_eq!(cl.flush_indices(), vec![2]);
        assert!(cl.is_boundary(3));
        assert!(!cl.is_boundary(4));
        let mut seen3 = [false; 2];
        for seed in 0..64 {
            for k in 0..=cl.len() {
                let img = cl.image(&spec(k, seed, 128, false));
                if k >= 3 {
                    assert_eq!(blk(&img, 1), &[1; BS][..]);
                    assert_eq!(blk(&img, 2), &[2; BS][..]);
                }
                if k >= 5 {
                    assert_eq!(blk(&img, 4), &[4; BS][..], "FUA write is durable");
                }
                if k <= 4 {
                    assert_eq!(blk(&img, 4), &[0; BS][..], "not yet issued");
                }
                if k == 6 {
                    seen3[(blk(&img, 3)[0] == 3) as usize] = true;
                }
                // Nothing beyond k ever appears.
                if k <= 5 {
                    assert_eq!(blk(&img, 5), &[0; BS][..]);
                }
            }
        }
        assert_eq!(seen3, [true, true], "volatile write both kept and dropped");
        // keep_256 = 0 drops every volatile write; the full image keeps them all.
        let img = cl.image(&spec(6, 1, 0, false));
        assert_eq!(blk(&img, 3), &[0; BS][..]);
        assert_eq!(blk(&img, 4), &[4; BS][..]);
        assert_eq!(cl.full_image(6), d.contents());
        assert_eq!(
            MemDevice::from_vec(cl.full_image(6)).into_vec(),
            d.contents()
        );
        // A filtered image may break the rules on purpose: drop a flushed write.
        let img = cl.image_filtered(6, |i, _| i != 0);
        assert_eq!(blk(&img, 1), &[0; BS][..]);
        assert_eq!(blk(&img, 2), &[2; BS][..]);
    }

    #[test]
    fn overlapping_volatile_writes_apply_in_log_order_or_later_dropped() {
        let d = RecordingDevice::new(vec![0; 4 * BS]);
        w(&d, 1, 1, false);
        w(&d, 1, 2, false);
        let cl = d.crash_log();
        let mut outcomes = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let img = cl.image(&spec(2, seed, 128, false));
            outcomes.insert(blk(&img, 1)[0]);
        }
        // 0 (both dropped), 1 (later dropped), 2 (later applied last).
        assert_eq!(outcomes.into_iter().collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn torn_writes_persist_whole_sectors_only() {
        let d = RecordingDevice::new(vec![0; 8 * BS]);
        d.write_at(0, &[9; 4 * BS], IoCategory::Journal, false)
            .unwrap();
        let cl = d.crash_log();
        let mut torn_seen = false;
        for seed in 0..200 {
            let s = spec(1, seed, 128, true);
            let img = cl.image(&s);
            let mut kept = 0;
            for sec in img[..4 * BS].chunks(SECTOR) {
                assert!(sec.iter().all(|&b| b == 9) || sec.iter().all(|&b| b == 0));
                kept += (sec[0] == 9) as usize;
            }
            if kept > 0 && kept < 8 {
                torn_seen = true;
                assert!(matches!(cl.fates(&s)[0], Fate::Torn(_)));
            }
        }
        assert!(torn_seen);
        // Writes overlapping an atomic range never tear.
        let sb: std::ops::Range<u64> = 1024..2048;
        let cl = cl.with_atomic(vec![sb]);
        for seed in 0..100 {
            assert!(!matches!(
                cl.fates(&spec(1, seed, 128, true))[0],
                Fate::Torn(_)
            ));
        }
        // Without `torn`, writes are all or nothing.
        for seed in 0..50 {
            let img = cl.image(&spec(1, seed, 128, false));
            let n = img[..4 * BS].iter().filter(|&&b| b == 9).count();
            assert!(n == 0 || n == 4 * BS);
        }
    }

    #[test]
    fn materializer_matches_direct_construction_in_any_order() {
        let d = RecordingDevice::new(vec![0; 32 * BS]);
        for i in 0..60usize {
            match i % 7 {
                3 => d.flush().unwrap(),
                5 => w(&d, i % 13, i as u8, true),
                _ => w(&d, i % 11, i as u8, false),
            }
        }
        let cl = d.crash_log();
        let mut m = Materializer::new(cl.clone());
        let mut out = Vec::new();
        let ks = [0, 3, 4, 10, 11, 30, 29, 2, 60, 45, 45];
        for (n, &k) in ks.iter().enumerate() {
            let s = spec(k, n as u64, 100, n % 2 == 0);
            m.image_into(&s, &mut out);
            assert_eq!(out, cl.image(&s), "k={k}");
        }
    }

    #[test]
    fn concurrent_writers_are_logged_consistently() {
        let d = Arc::new(RecordingDevice::new(vec![0; 64 * BS]));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for i in 0..200usize {
                        let b = (i * 7 + t as usize) % 64;
                        d.write_at((b * BS) as u64, &[t + 1; BS], IoCategory::Data, false)
                            .unwrap();
                        if i % 50 == 0 {
                            d.flush().unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let cl = d.crash_log();
        assert_eq!(cl.len(), 4 * 200 + 4 * 4);
        // Replaying the log in order reproduces the device exactly.
        assert_eq!(cl.full_image(cl.len()), d.contents());
    }
}
