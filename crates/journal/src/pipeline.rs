//! The commit pipeline (CJFS §4, docs/ARCHITECTURE.md "Design: concurrent
//! journaling", part A and B).
//!
//! Two threads per journal with a log:
//!
//! * **commit thread** (commit stage, CJFS §4.1 dual-stage commit): picks the
//!   running transaction when someone asked for it, locks it (new handles wait),
//!   waits for its handles to stop, freezes a copy of each dirty buffer into the
//!   buffer's [`crate::Versions`] (multi-version shadow buffers, CJFS §4.2), switches
//!   to the next tid (handles resume at once) and writes the transaction's log
//!   blocks without a flush. It goes on with the next transaction while the
//!   previous ones are being made durable: up to `max_inflight` in flight.
//! * **flush thread** (flush stage, CJFS §4.4 compound flush): one flush makes
//!   durable the commit blocks written after the previous flush *and* the log
//!   blocks of every transaction written since; then it writes those
//!   transactions' commit blocks, which the next flush makes durable. With nothing
//!   following, the last commit block goes out with FUA instead (the serial
//!   trace: log, flush, commit FUA).
//!
//! Ordering without a cache barrier (ARCHITECTURE.md B): C(T) is written only
//! after a flush that began after T's log blocks (and data, and earlier commit
//! blocks) completed (I1); log space is reserved in tid order (I2), so recovery,
//! which walks the log expecting each next tid, stops at the first transaction
//! whose commit block is missing and never replays T+1 without T; waiters are
//! released in tid order (`committed_tid` advances over a durable prefix, I5).
//!
//! Opportunistic coalescing (CJFS §4.3): when a buffer of the transaction to
//! commit already has `max_versions` copies in flight, the commit thread unlocks
//! the running transaction, which keeps taking handles (its changes coalesce),
//! and retries once the oldest transaction in flight is durable.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use commitfs_device::IoCategory;

use crate::{tid_le, Buffer, Core, InFlight, JournalError, Result, TxState, WAIT_SLICE};

/// How long the batching wait watches for new handles before deciding the
/// arrivals have stopped.
const BATCH_STEP: Duration = Duration::from_micros(100);

/// How long the flush thread waits at most for a commit being written to join
/// its flush: about one flush of the device ([`Core::flush_batch`]), within
/// these bounds (the upper one is a SATA SSD's flush).
const FLUSH_BATCH_MIN: Duration = Duration::from_micros(100);
const FLUSH_BATCH: Duration = Duration::from_micros(1500);

/// How long no new commit request must come before the commit thread stops
/// gathering after a flush.
const GATHER_QUIET: Duration = Duration::from_micros(200);

/// How long a lone commit block waits for a follower before it goes out with
/// FUA: a third of [`Core::flush_batch`] (500 µs with a 1.5 ms flush).
const FUA_WAIT_DIV: u32 = 3;

/// Pipeline settings (mount options in commitfs-fs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineOptions {
    /// Transactions in flight at most (committing or written, not durable).
    pub max_inflight: usize,
    /// Copies of one buffer in flight at most (CJFS §4.2; §6.1 found 5 enough).
    pub max_versions: usize,
    /// jbd2's `min_batch_time` / `max_batch_time` (µs): how long the commit
    /// thread lets a transaction gather more handles before it locks it, when
    /// handles are still arriving.
    pub min_batch_us: u64,
    pub max_batch_us: u64,
}

/// A pipeline mount option with a value it does not take.
#[derive(Debug, thiserror::Error)]
#[error("bad mount option {key}={value}: {why}")]
pub struct BadPipelineOption {
    pub key: String,
    pub value: String,
    pub why: &'static str,
}

impl PipelineOptions {
    /// Apply the mount option `key=value` if it is one of the pipeline's
    /// (`max_inflight`, `max_versions`: 1 to 64; `min_batch_time`,
    /// `max_batch_time`: µs). `Ok(false)`: not a pipeline option. One parser for
    /// the mount command and the bench's library pass.
    pub fn set(&mut self, key: &str, value: &str) -> std::result::Result<bool, BadPipelineOption> {
        let bad = |why| BadPipelineOption {
            key: key.into(),
            value: value.into(),
            why,
        };
        if !matches!(
            key,
            "max_inflight" | "max_versions" | "min_batch_time" | "max_batch_time"
        ) {
            return Ok(false);
        }
        let n: u64 = value.parse().map_err(|_| bad("a number is expected"))?;
        match key {
            "max_inflight" | "max_versions" if !(1..=64).contains(&n) => {
                return Err(bad("1 to 64"))
            }
            "max_inflight" => self.max_inflight = n as usize,
            "max_versions" => self.max_versions = n as usize,
            "min_batch_time" => self.min_batch_us = n,
            _ => self.max_batch_us = n,
        }
        Ok(true)
    }
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            max_inflight: 4,
            max_versions: 3,
            min_batch_us: 0,
            max_batch_us: 15_000,
        }
    }
}

/// Start the commit and flush threads.
pub(crate) fn spawn(core: &Arc<Core>) -> Result<Vec<std::thread::JoinHandle<()>>> {
    let spawn_one = |name: &str, f: fn(&Core) -> Result<bool>| {
        let c = core.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run(&c, f))
            .map_err(|e| JournalError::BadJournal(format!("cannot start thread {name}: {e}")))
    };
    Ok(vec![
        spawn_one("commitfs-jcommit", Core::commit_step)?,
        spawn_one("commitfs-jflush", Core::flush_step)?,
    ])
}

fn run(core: &Core, step: fn(&Core) -> Result<bool>) {
    loop {
        match step(core) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => core.pipeline_failed(&e),
        }
    }
}

impl Core {
    /// The flush thread's wait for a successor commit to share its flush: one
    /// average flush of this device, between [`FLUSH_BATCH_MIN`] and
    /// [`FLUSH_BATCH`] (waiting longer than a flush takes would cost more
    /// than the flush it saves; on a loop device a flush takes a fraction of a
    /// SATA SSD's).
    pub(crate) fn flush_batch(&self) -> Duration {
        self.gens
            .flush_avg()
            .map_or(FLUSH_BATCH, |d| d.clamp(FLUSH_BATCH_MIN, FLUSH_BATCH))
    }

    /// Whether the commit thread has a transaction to commit now.
    fn commit_wanted(&self, q: &crate::TxQueue) -> bool {
        let r = &q.running;
        (!r.is_empty() && q.commit_req != 0 && tid_le(r.tid, q.commit_req))
            || q.force == Some(r.tid)
    }

    /// One iteration of the commit thread. `Ok(false)`: stop.
    fn commit_step(&self) -> Result<bool> {
        let log = self.log.as_ref().expect("pipeline without a log");
        let mut q = self.txq.lock();
        loop {
            let want = self.commit_wanted(&q);
            if self.is_aborted() || (q.stop && !want) {
                if q.stop {
                    return Ok(false);
                }
            } else if want
                && !q.fc_ongoing
                && q.hold == 0
                && q.inflight.len() < self.opts.max_inflight.max(1)
            {
                break;
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        }
        // Batching (jbd2's min/max_batch_time and its "other syncers" test): when
        // several callers are asking for commits, let the transaction gather
        // the handles still arriving, for at least `min_batch_us` and while new
        // handles keep starting, up to the average commit time (at most
        // `max_batch_us`). One caller alone never waits.
        let t_req = std::time::Instant::now();
        let concurrent = q.requesters > 1 || !q.inflight.is_empty();
        if concurrent && self.opts.max_batch_us > 0 {
            let t0 = std::time::Instant::now();
            let min = Duration::from_micros(self.opts.min_batch_us);
            let avg = {
                let s = self.stats.lock();
                Duration::from_nanos(s.commit_ns.checked_div(s.commits).unwrap_or(0))
            };
            let max = Duration::from_micros(self.opts.max_batch_us).min(avg.max(min));
            let deadline = t0 + max;
            if !q.inflight.is_empty() {
                // Pipeline busy: a flush in progress cannot make this transaction
                // durable anyway, so gather handles until it ends; then go at
                // once: the flush thread waits for this log to share its next
                // flush with the commit blocks it just wrote (compound flush).
                while q.flush_busy && std::time::Instant::now() < deadline && !q.stop {
                    self.cv.wait_until(&mut q, deadline);
                }
                // The callers that flush released come back with their next
                // requests: keep gathering while requests keep arriving (until
                // none came for GATHER_QUIET and as many as lately have asked),
                // less long than the flush thread waits for this log.
                let until = std::time::Instant::now() + self.flush_batch() * 3 / 4;
                let target = q.peak_requesters.max(1);
                let (mut seen, mut since) = (q.requesters, std::time::Instant::now());
                loop {
                    let now = std::time::Instant::now();
                    if now >= until || q.stop {
                        break;
                    }
                    if q.requesters != seen {
                        (seen, since) = (q.requesters, now);
                    } else if now - since >= GATHER_QUIET && q.requesters >= target {
                        break;
                    }
                    self.cv
                        .wait_until(&mut q, (now + BATCH_STEP / 2).min(until));
                }
            } else {
                // First commit of a burst: wait for as many callers as the last
                // batches had (a caller released by the last commit is busy with
                // its next request, through FUSE for longer than any fixed quiet
                // period), at least `min_batch_us`; the mark follows what the
                // wait saw, up or down.
                let target = q.peak_requesters.max(1);
                loop {
                    let now = std::time::Instant::now();
                    let e = now - t0;
                    if now >= deadline || q.stop || (q.requesters >= target && e >= min) {
                        break;
                    }
                    let until = (now + BATCH_STEP).min(deadline);
                    self.cv.wait_until(&mut q, until);
                }
            }
            q.peak_requesters = q.requesters;
            if !self.commit_wanted(&q) || q.fc_ongoing || q.hold > 0 || self.is_aborted() {
                return Ok(true);
            }
        }
        q.requesters = 0;
        let t_lock = std::time::Instant::now();
        let batch_ns = (t_lock - t_req).as_nanos() as u64;
        // T_LOCKED: no handle starts; wait for the open ones to stop. With a
        // page cache, the file system's cut comes first and locks inside it.
        let hooks = self.hooks();
        if let Some(hk) = &hooks {
            let tid = q.running.tid;
            drop(q);
            let mut locked = false;
            hk.cut(tid, &mut || {
                let mut q = self.txq.lock();
                if q.running.tid == tid
                    && !q.running.locked
                    && !q.fc_ongoing
                    && q.hold == 0
                    && !self.is_aborted()
                {
                    q.running.locked = true;
                    locked = true;
                }
                locked
            })?;
            q = self.txq.lock();
            if !locked {
                return Ok(true);
            }
        } else {
            q.running.locked = true;
        }
        while q.running.handles > 0 {
            if self.is_aborted() {
                q.running.locked = false;
                self.cv.notify_all();
                if let Some(hk) = &hooks {
                    // The cut's pages are given back (aborted: not written).
                    let tid = q.running.tid;
                    drop(q);
                    let _ = hk.write_data(tid);
                }
                return Ok(true);
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        }
        // Opportunistic coalescing (CJFS §4.3): a buffer with `max_versions`
        // copies in flight cannot take another; let the running transaction go on
        // accepting handles and retry once the oldest in flight is durable.
        let cap = self.opts.max_versions.max(1);
        let conflict = q
            .running
            .buffers
            .values()
            .any(|b| b.vers.lock().inflight.len() >= cap);
        if conflict && !q.inflight.is_empty() {
            q.running.locked = false;
            self.cv.notify_all();
            self.stats.lock().lock_unlocks += 1;
            let oldest = q.inflight.front().map(|t| t.tid);
            if let Some(hk) = &hooks {
                // The cut's data must not wait for this transaction's commit.
                let tid = q.running.tid;
                drop(q);
                hk.write_data(tid)?;
                q = self.txq.lock();
            }
            drop(hooks);
            while !self.is_aborted() && q.inflight.front().map(|t| t.tid) == oldest {
                self.cv.wait_for(&mut q, WAIT_SLICE);
            }
            return Ok(true);
        }
        let tid = q.running.tid;
        let buffers = std::mem::take(&mut q.running.buffers);
        let revokes = std::mem::take(&mut q.running.revokes);
        let handles = std::mem::take(&mut q.running_handles_total);
        // Its data blocks: guarded from now on (a handle of the next transaction
        // must not overwrite them in place before this commit, and a later one
        // behind it, are durable).
        if q.running.data.on {
            if let Some(hk) = &hooks {
                for (p, n) in hk.data_ranges(tid) {
                    q.running.data.running.insert(p, p.saturating_add(n));
                }
            }
        }
        let data = if q.running.data.on {
            let mut d = std::mem::take(&mut q.running.data.running);
            d.union(&std::mem::take(&mut q.running.data.flushing));
            q.running.data.committing.insert(tid, d.clone());
            Some(d)
        } else {
            None
        };
        if q.force == Some(tid) {
            q.force = None;
        }
        drop(q);
        // Freeze while `locked` keeps handles out: a copy taken after the tid
        // switch could contain half an operation of the next transaction.
        let mut frozen: Vec<(Arc<Buffer>, Arc<[u8]>)> = Vec::with_capacity(buffers.len());
        for b in buffers.into_values() {
            b.dirty.store(false, Ordering::Release);
            let copy: Arc<[u8]> = Arc::from(&b.data.read()[..]);
            b.vers.lock().inflight.push((tid, copy.clone()));
            frozen.push((b, copy));
        }
        let mut q = self.txq.lock();
        q.running.tid = tid.wrapping_add(1);
        q.running.locked = false;
        // A single-flush commit only with nothing unflushed before it (I4): its
        // commit block makes it final without ordering against a predecessor.
        let single_ok = q.inflight.is_empty();
        q.inflight.push_back(InFlight {
            tid,
            state: TxState::Committing,
            bufs: Vec::new(),
            revokes: Default::default(),
            commit: None,
            single_data: None,
            log_blocks: 0,
            handles,
            started: std::time::Instant::now(),
        });
        {
            let mut s = self.stats.lock();
            s.batch_ns += batch_ns;
            s.lock_ns += t_lock.elapsed().as_nanos() as u64;
        }
        let n = q.inflight.len() as u64;
        self.cv.notify_all();
        drop(q);
        {
            let mut s = self.stats.lock();
            s.max_inflight = s.max_inflight.max(n);
        }
        // Ordered mode: the file data this transaction maps, before its log
        // blocks (and before the single-flush checksums read it back).
        if let Some(hk) = &hooks {
            hk.write_data(tid)?;
        }
        // Not kept while the commit completes: its waiters may drop the file
        // system (the hooks' owner) as soon as it is durable.
        drop(hooks);
        let ext = match &data {
            Some(d) if single_ok && log.lock().csum_v3() => self.data_crcs(d),
            _ => None,
        };
        let revoke_list: Vec<u64> = revokes.iter().copied().collect();
        // Log space: a checkpoint first if it is short; that restarts the log, so
        // every earlier transaction must be durable (drain). Memory too: the
        // buffers waiting for a checkpoint cannot be evicted and hold a second
        // copy, so once they would pass half the cache's bound (a third of the
        // memory bound, `Journal::set_cache_limit`) they are written home first
        // (the kernel's flusher writes committed metadata back on its own).
        // Once per commit: a checkpoint may leave blocks on the list (those
        // freed by a transaction not committed yet), so the test could stay true.
        let waiting = log.lock().checkpoint_list().lock().len();
        let mut over_memory =
            waiting > 0 && waiting + frozen.len() > self.cache_limit.load(Ordering::Relaxed) / 2;
        loop {
            if !std::mem::take(&mut over_memory)
                && !log.lock().needs_checkpoint(frozen.len(), &revoke_list)?
            {
                break;
            }
            let mut q = self.txq.lock();
            while q.inflight.front().map(|t| t.tid) != Some(tid) {
                if self.is_aborted() {
                    return Err(JournalError::Aborted);
                }
                self.cv.wait_for(&mut q, WAIT_SLICE);
            }
            drop(q);
            log.lock().checkpoint(&*self.dev)?;
            self.count_flush();
            self.stats.lock().checkpoints += 1;
            self.txq.lock().running.data.protected = None;
        }
        let t_write = std::time::Instant::now();
        let body = log
            .lock()
            .write_body(&*self.dev, tid, &frozen, &revokes, ext.as_deref())?;
        self.stats.lock().log_write_ns += t_write.elapsed().as_nanos() as u64;
        let mut q = self.txq.lock();
        let t = q
            .inflight
            .iter_mut()
            .find(|t| t.tid == tid)
            .expect("own transaction in flight");
        t.bufs = frozen.into_iter().map(|(b, _)| b).collect();
        t.revokes = revokes;
        t.log_blocks = body.log_blocks;
        t.state = if body.commit.is_some() {
            TxState::Committing
        } else {
            TxState::Written
        };
        t.single_data = if body.commit.is_none() { data } else { None };
        t.commit = body.commit;
        // `Committing` with `bufs` set = log blocks written.
        t.handles = t.handles.max(1);
        self.cv.notify_all();
        Ok(true)
    }

    /// Whether transaction `t`'s log writes are done (ready for a flush).
    fn log_written(t: &InFlight) -> bool {
        t.state == TxState::Written || (t.state == TxState::Committing && t.commit.is_some())
    }

    /// One iteration of the flush thread. `Ok(false)`: stop.
    fn flush_step(&self) -> Result<bool> {
        let mut q = self.txq.lock();
        loop {
            if self.is_aborted() {
                if q.stop {
                    return Ok(false);
                }
            } else {
                let ready = q.inflight.front().is_some_and(Self::log_written);
                let flush_wanted = q.flush_req > self.gens.done.load(Ordering::Acquire);
                if (ready || flush_wanted) && !q.fc_ongoing {
                    break;
                }
                if q.stop && q.inflight.is_empty() {
                    return Ok(false);
                }
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        }
        // A successor's writes are coming, which this flush could cover too
        // (CJFS §4.4: one flush for consecutive commits): the commit thread is
        // about to write, or writing, a successor's log blocks; or a chained
        // fast commit expects the next fast commit, whose pre-tail flush then
        // serves its waiters' request (`TxQueue::fc_handoff`, never held for a
        // full commit whose log is written). Wait for at most a fraction of a
        // flush.
        let until = std::time::Instant::now() + self.flush_batch();
        loop {
            let now = std::time::Instant::now();
            if now >= until || self.is_aborted() || q.stop {
                break;
            }
            if q.fc_handoff.is_some_and(|d| now >= d)
                || q.inflight.front().is_some_and(Self::log_written)
            {
                q.fc_handoff = None;
            }
            let successor = self.commit_wanted(&q)
                || q.running.locked
                || q.inflight.back().is_some_and(|t| {
                    t.state == TxState::Committing && t.commit.is_none() && t.bufs.is_empty()
                })
                || q.fc_handoff.is_some();
            if !successor {
                break;
            }
            let wake = q.fc_handoff.map_or(until, |d| d.min(until));
            self.cv.wait_until(&mut q, wake);
        }
        if q.fc_ongoing
            || !(q.inflight.front().is_some_and(Self::log_written)
                || q.flush_req > self.gens.done.load(Ordering::Acquire))
        {
            // A fast commit claimed the slot meanwhile (its flush may serve
            // the request), or nothing is wanted any more: look again.
            return Ok(true);
        }
        // The prefix whose writes are complete: this flush makes it durable (log
        // blocks, or commit blocks already written).
        let snap: Vec<(u32, TxState)> = q
            .inflight
            .iter()
            .take_while(|t| Self::log_written(t))
            .map(|t| (t.tid, t.state))
            .collect();
        q.flush_busy = true;
        if q.running.data.on {
            let d = std::mem::take(&mut q.running.data.running);
            q.running.data.flushing.union(&d);
        }
        drop(q);
        let r = self.dev.flush();
        self.count_flush();
        {
            let mut q = self.txq.lock();
            q.flush_busy = false;
            let d = std::mem::take(&mut q.running.data.flushing);
            if r.is_err() {
                q.running.data.running.union(&d);
            }
            self.cv.notify_all();
        }
        r?;
        let mut completed = 0u64;
        for &(tid, st) in &snap {
            if st == TxState::Written {
                self.complete(tid)?;
                completed += 1;
            }
        }
        let logw: Vec<u32> = snap
            .iter()
            .filter(|(_, s)| *s == TxState::Committing)
            .map(|(t, _)| *t)
            .collect();
        for &tid in &logw {
            let (off, block, fua) = {
                let mut q = self.txq.lock();
                let last = logw.len() == 1 && q.inflight.back().is_some_and(|t| t.tid == tid);
                // Other threads are at work in the running transaction: a commit
                // request for it is likely to come at once; give it a moment, so
                // that C(T) rides on the next flush instead of costing a FUA write
                // (a flush on devices without FUA). One thread fsyncing alone
                // never waits: it is blocked on T, so no handle starts.
                if last && q.running_handles_total > 0 && !self.commit_wanted(&q) {
                    let until = std::time::Instant::now() + self.flush_batch() / FUA_WAIT_DIV;
                    while !self.commit_wanted(&q) && std::time::Instant::now() < until && !q.stop {
                        self.cv.wait_until(&mut q, until);
                    }
                }
                let alone = last && !self.commit_wanted(&q);
                let t = q
                    .inflight
                    .iter_mut()
                    .find(|t| t.tid == tid)
                    .expect("transaction in flight");
                let (off, block) = t.commit.take().expect("commit block to write");
                (off, block, alone)
            };
            // Nothing follows: FUA, durable at once (the serial trace). Otherwise
            // the next flush makes it durable together with what follows.
            self.dev.write_at(off, &block, IoCategory::Journal, fua)?;
            if fua {
                self.complete(tid)?;
            } else {
                let mut q = self.txq.lock();
                if let Some(t) = q.inflight.iter_mut().find(|t| t.tid == tid) {
                    t.state = TxState::Written;
                }
                self.cv.notify_all();
            }
        }
        if completed > 0 {
            let mut s = self.stats.lock();
            s.commit_flushes += 1;
            s.commits_by_flush += completed;
            s.max_commits_per_flush = s.max_commits_per_flush.max(completed);
        }
        Ok(true)
    }

    /// Transaction `tid` (the oldest in flight) is durable: publish its versions
    /// as committed, release its waiters.
    fn complete(&self, tid: u32) -> Result<()> {
        let log = self.log.as_ref().expect("pipeline without a log");
        let (bufs, revokes) = {
            let mut q = self.txq.lock();
            match q.inflight.front_mut() {
                Some(t) if t.tid == tid => {
                    (std::mem::take(&mut t.bufs), std::mem::take(&mut t.revokes))
                }
                _ => {
                    return Err(JournalError::BadJournal(format!(
                        "transaction {tid} completed out of order"
                    )))
                }
            }
        };
        log.lock().committed(&*self.dev, tid, &bufs, &revokes)?;
        // Before the waiters are released: their next fast commit must find the
        // kept block home (`Core::keep_home`).
        self.write_kept_home()?;
        let n = bufs.len() as u64;
        {
            let mut q = self.txq.lock();
            let t = q.inflight.pop_front().expect("front transaction");
            self.committed_tid.store(tid, Ordering::Release);
            q.running.data.committing.remove(&tid);
            // A durable commit makes every earlier one non-final; a single-flush
            // one with data ranges is itself final until a later commit is
            // durable behind it.
            q.running.data.protected = match t.single_data {
                Some(d) if !d.is_empty() => Some((tid, d)),
                _ => None,
            };
            q.running.data.unprotect_after = None;
            if q.force.is_some_and(|f| tid_le(f, tid)) {
                q.force = None;
            }
            let mut s = self.stats.lock();
            s.commits += 1;
            s.buffers_written += n;
            s.log_blocks += t.log_blocks;
            s.revokes += revokes.len() as u64;
            s.commit_handles += t.handles;
            s.commit_ns += t.started.elapsed().as_nanos() as u64;
            drop(s);
            self.cv.notify_all();
        }
        Ok(())
    }
}
