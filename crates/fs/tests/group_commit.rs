//! Group commit and compound flush, by counts (issue #10, acceptance 2): 16
//! threads each create a file in their own directory, write 4 KiB and fsync it,
//! on a device whose cache flush and FUA writes are slow (so fsyncs overlap), in
//! every journal mode: JBD2 (no fast_commit), fast commit, and fast commit with
//! `fc_data_csum`. Checked: at most 0.2 device flushes per fsync; more than one
//! fsync served per commit; in JBD2 mode (in one of up to three rounds) more
//! than one transaction made durable by one flush (CJFS §4.4 compound flush)
//! and more than one transaction in flight; and every fsync durable: the image a power cut leaves right after an
//! fsync returned recovers with that file and its data; the final image is clean.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use commitfs_fs::testutil::mkfs;
use commitfs_fs::*;
use common::{check_fsyncs_durable, FsyncDone, SlowDevice};

const THREADS: u32 = 16;
const ROUNDS: u32 = 25;
const FILE_BYTES: usize = 4096;
const MAX_FLUSHES_PER_FSYNC: f64 = 0.2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Jbd2,
    FastCommit,
    FcDataCsum,
}

fn content(t: u32, i: u32) -> Vec<u8> {
    (0..FILE_BYTES)
        .map(|b| (t * 37 + i * 101 + b as u32 / 7) as u8 | 1)
        .collect()
}

/// One mode at a time: the counts depend on fsyncs overlapping in time, and
/// the other modes' 16 threads on the same (2-CPU) machine would delay them
/// (a run beside another measured 0.205 flushes per fsync once).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// One round; returns the most transactions one flush made durable, the most
/// in flight at once (JBD2's compound flush, checked by its test) and the
/// fast commits chained onto a successor's flush.
fn run(mode: Mode) -> (u64, u64, u64) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut args = vec!["-b", "4096"];
    if mode != Mode::Jbd2 {
        args.extend(["-O", "fast_commit"]);
    }
    args.extend(["-J", "size=32"]);
    let img = mkfs("groupcommit", 128, &args);
    let dev = Arc::new(SlowDevice::new(
        std::fs::read(&img.path).unwrap(),
        Duration::from_millis(2),
    ));
    let fs = Fs::open(
        dev.clone(),
        MountOptions {
            commit_interval: 0,
            fc_data_csum: mode == Mode::FcDataCsum,
            ..Default::default()
        },
    )
    .unwrap();
    let dirs: Vec<Ino> = (0..THREADS)
        .map(|t| {
            fs.mkdir(ROOT_INO, format!("t{t}").as_bytes(), 0o755, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    fs.sync().unwrap();
    let s0 = fs.stats();
    let fc0 = fs.fc_stats();
    let flushes0 = dev.flushes.load(Ordering::Relaxed);
    let done = Mutex::new(Vec::<FsyncDone>::new());
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (fs, dev, done, dir) = (&fs, &dev, &done, dirs[t as usize]);
            s.spawn(move || {
                for i in 0..ROUNDS {
                    let a = fs
                        .create(dir, format!("f{i}").as_bytes(), 0o644, 0, 0)
                        .unwrap();
                    fs.write(a.ino, 0, &content(t, i)).unwrap();
                    fs.fsync(a.ino, false).unwrap();
                    done.lock().unwrap().push(FsyncDone {
                        t,
                        i,
                        ops: dev.inner.op_count(),
                    });
                }
            });
        }
    });
    let s1 = fs.stats();
    let fc1 = fs.fc_stats();
    let fsyncs = s1.fsyncs - s0.fsyncs;
    let flushes = dev.flushes.load(Ordering::Relaxed) - flushes0;
    let j = |f: fn(&commitfs_journal::JournalStats) -> u64| f(&s1.journal) - f(&s0.journal);
    let commits = j(|s| s.commits);
    let fast = fc1.commits - fc0.commits;
    let ratio = flushes as f64 / fsyncs as f64;
    eprintln!(
        "{mode:?}: {fsyncs} fsyncs, {flushes} device flushes ({ratio:.3} per fsync), \
         {commits} full commits, {fast} fast commits, {} commits by {} flushes (max {}), \
         max {} in flight, {} coalescing unlocks, {} fast commits chained, fallbacks {:?}",
        j(|s| s.commits_by_flush),
        j(|s| s.commit_flushes),
        s1.journal.max_commits_per_flush,
        s1.journal.max_inflight,
        j(|s| s.lock_unlocks),
        j(|s| s.fc_chained),
        fc1.ineligible
    );
    assert_eq!(fsyncs, (THREADS * ROUNDS) as u64);
    assert!(
        ratio <= MAX_FLUSHES_PER_FSYNC,
        "{mode:?}: {flushes} flushes for {fsyncs} fsyncs ({ratio:.3} > {MAX_FLUSHES_PER_FSYNC})"
    );
    let served_commits = match mode {
        Mode::Jbd2 => commits,
        _ => commits + fast,
    };
    assert!(
        served_commits > 0 && served_commits < fsyncs,
        "{mode:?}: {served_commits} commits for {fsyncs} fsyncs: no fsync shared a commit"
    );

    // Durability at sampled fsync returns, then everything.
    let done = done.into_inner().unwrap();
    check_fsyncs_durable(
        &dev.inner,
        done,
        content,
        8,
        &img.path,
        &format!("{mode:?}"),
    );
    fs.unmount().unwrap();
    (
        s1.journal.max_commits_per_flush,
        s1.journal.max_inflight,
        j(|s| s.fc_chained),
    )
}

/// Compound flush needs a commit's log written while the flush of the one
/// before it runs; on a loaded 2-CPU machine one round can miss that (seen
/// once in CI: 27 commits by 27 flushes, beside other test binaries). Up to
/// three rounds, each checked in full; one must show it.
#[test]
fn jbd2_sixteen_threads_share_commits_and_flushes() {
    for round in 1..=3 {
        let (per_flush, inflight, _) = run(Mode::Jbd2);
        if per_flush > 1 && inflight >= 2 {
            return;
        }
        eprintln!(
            "JBD2 round {round}: at most {per_flush} commits per flush, {inflight} in flight"
        );
    }
    panic!(
        "JBD2: in three rounds no flush made more than one transaction durable \
         (compound flush) with two in flight"
    );
}

/// Fast commits share a flush by chaining (docs/ARCHITECTURE.md "Chained
/// fast commits"): a commit that an fsync arriving after its plan needs a
/// successor for leaves its durability to that successor's flush. Whether
/// such an fsync arrives in the window depends on thread timing: up to three
/// rounds, each checked in full; one must show a chained commit.
fn fast_commits_chain(mode: Mode) {
    for round in 1..=3 {
        let (_, _, chained) = run(mode);
        if chained > 0 {
            return;
        }
        eprintln!("{mode:?} round {round}: no fast commit shared a flush");
    }
    panic!("{mode:?}: in three rounds no flush made two fast commits durable");
}

#[test]
fn fast_commit_sixteen_threads_share_commits_and_flushes() {
    fast_commits_chain(Mode::FastCommit);
}

/// Single-flush fast commits chain too, but here rarely (0-5 of ~30 per
/// round: with no flush before its TAIL a commit's window for a new arrival
/// is short); `fc_data_csum::chained_fast_commits_share_a_flush_and_recovery_verifies_both`
/// shows the shared flush deterministically.
#[test]
fn fc_data_csum_sixteen_threads_share_commits_and_flushes() {
    run(Mode::FcDataCsum);
}
