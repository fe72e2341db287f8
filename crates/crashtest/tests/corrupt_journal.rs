//! A damaged live log: a bad descriptor-block checksum, a bad commit-block
//! checksum, or a wrong sequence number in a later transaction. Recovery must stop
//! at the last valid transaction, say so in its log message, and apply nothing of
//! the damaged transaction or any after it: the recovered tree equals the model at
//! the last valid transaction, blocks logged only by later transactions keep their
//! pre-recovery content, and e2fsck is clean.

use std::collections::BTreeSet;
use std::io::Write;
use std::sync::{Arc, Mutex};

use commitfs_crashtest::check::{fsck_image, meta_matches_ignoring_data_blocks};
use commitfs_crashtest::jlog::{journal_blocks, log_format, logged_blocks, reseal_tail, LogBlock};
use commitfs_crashtest::observe::{diff, observe};
use commitfs_crashtest::{base_image, find, record, Recording, ScratchFile};
use commitfs_device::MemDevice;
use commitfs_format::bytes::be32;
use commitfs_format::jbd2::{self, BLOCKTYPE_COMMIT, BLOCKTYPE_DESCRIPTOR};
use commitfs_fs::{Fs, MountOptions};

/// Collects everything the tracing subscriber writes.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Capture {
    type Writer = Capture;
    fn make_writer(&'a self) -> Capture {
        self.clone()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Damage {
    DescriptorChecksum,
    CommitChecksum,
    WrongSequence,
}

/// The live transactions at crash point `k`: commit blocks written after the last
/// time the journal superblock marked the log empty, with the model snapshot each
/// makes durable (the start of the fsync that wrote it).
fn live_transactions(rec: &Recording, blocks: &[LogBlock]) -> Vec<(u32, usize)> {
    let last_reset = blocks
        .iter()
        .filter(|b| b.is_superblock() && be32(&b.data, jbd2::S_START) == 0)
        .map(|b| b.log_idx)
        .max()
        .unwrap_or(0);
    blocks
        .iter()
        .filter(|b| b.blocktype == BLOCKTYPE_COMMIT && b.log_idx > last_reset)
        .map(|b| {
            let s = rec
                .syncs
                .iter()
                .find(|s| s.start_idx <= b.log_idx && b.log_idx < s.ret_idx)
                .expect("every commit happens inside an fsync (commit_interval=0)");
            (b.seq, s.model_idx)
        })
        .collect()
}

fn damaged_log(damage: Damage, workload: &str, seed: u64, bs: u32) {
    let base = base_image(bs).unwrap();
    let rec = record(find(workload).unwrap(), &base, seed).unwrap();
    let bsz = rec.bs;
    let k = rec.unmount_start;
    let mut img = rec.log.full_image(k);
    let blocks = journal_blocks(&rec.log, bsz, k);
    let live = live_transactions(&rec, &blocks);
    assert!(
        live.len() >= 6,
        "need a log with several transactions, got {live:?}"
    );
    let jsb_off = blocks
        .iter()
        .rev()
        .find(|b| b.is_superblock())
        .unwrap()
        .offset;
    let f = log_format(&img, jsb_off, bsz).unwrap();
    let logged = |tids: &[u32]| -> BTreeSet<u64> {
        tids.iter()
            .flat_map(|&t| logged_blocks(&blocks, t, &f).unwrap())
            .collect()
    };
    // The damaged transaction: one in the middle whose later part logs blocks the
    // earlier part does not (so "nothing applied after it" can be seen on disk).
    let sb_block = if bsz == 1024 { 1 } else { 0 };
    let (t_idx, only_after) = (live.len() / 2..live.len() - 1)
        .find_map(|i| {
            let before: Vec<u32> = live[..i].iter().map(|t| t.0).collect();
            let after: Vec<u32> = live[i..].iter().map(|t| t.0).collect();
            let only: BTreeSet<u64> = logged(&after)
                .difference(&logged(&before))
                .copied()
                .filter(|&b| b != sb_block)
                .collect();
            (!only.is_empty()).then_some((i, only))
        })
        .expect("a transaction logging new blocks");
    let (tid, _) = live[t_idx];
    let (prev_tid, expected_snap) = live[t_idx - 1];
    let desc = blocks
        .iter()
        .find(|b| b.seq == tid && b.blocktype == BLOCKTYPE_DESCRIPTOR)
        .expect("descriptor of the damaged transaction");
    let commit = blocks
        .iter()
        .find(|b| b.seq == tid && b.blocktype == BLOCKTYPE_COMMIT)
        .unwrap();
    match damage {
        Damage::DescriptorChecksum => {
            // Flip a bit of the tail checksum (§8.5).
            let o = desc.offset as usize + bsz - 1;
            img[o] ^= 0x01;
        }
        Damage::CommitChecksum => {
            // h_chksum[0] of the commit block is at 0x10 (§8.8).
            img[commit.offset as usize + 0x10] ^= 0x01;
        }
        Damage::WrongSequence => {
            // A well-formed descriptor (valid checksum) from the wrong transaction.
            let o = desc.offset as usize;
            let blk = &mut img[o..o + bsz];
            blk[8..12].copy_from_slice(&tid.wrapping_add(1000).to_be_bytes());
            reseal_tail(blk, &f);
        }
    }
    let pre = img.clone();

    let cap = Capture::default();
    let sub = tracing_subscriber::fmt()
        .with_writer(cap.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let dev = Arc::new(MemDevice::from_vec(img));
    let fs = tracing::subscriber::with_default(sub, || {
        Fs::open(
            dev.clone(),
            MountOptions {
                read_only: false,
                commit_interval: 0,
                ..Default::default()
            },
        )
    })
    .unwrap_or_else(|e| panic!("{damage:?}: mount failed: {e}"));
    let msg = String::from_utf8_lossy(&cap.0.lock().unwrap()).into_owned();
    println!("{damage:?} of transaction {tid} (bs {bsz}): {}", msg.trim());

    // The log message names the transactions replayed and, for checksum damage,
    // why the scan stopped.
    let first_tid = live[0].0;
    assert!(
        msg.contains(&format!("({first_tid}..{tid})")),
        "{damage:?}: the recovery message must show transactions {first_tid}..{tid}: {msg}"
    );
    match damage {
        Damage::DescriptorChecksum => assert!(
            msg.contains("stopped early")
                && msg.contains(&format!("transaction {tid}"))
                && msg.contains("checksum"),
            "{msg}"
        ),
        Damage::CommitChecksum => assert!(
            msg.contains("stopped early") && msg.contains("commit block checksum"),
            "{msg}"
        ),
        Damage::WrongSequence => {}
    }

    // Nothing after the last valid transaction reached home.
    let after = dev.contents();
    for &b in &only_after {
        let r = b as usize * bsz..(b as usize + 1) * bsz;
        assert!(
            after[r.clone()] == pre[r],
            "{damage:?}: block {b}, logged only by transactions >= {tid}, was written"
        );
    }
    // The namespace and metadata are exactly the model after transaction
    // `prev_tid`. Data blocks are not compared: the lost transactions freed blocks
    // that later committed ones reused, and their data was written in place.
    let obs = observe(&fs, rec.max_file_size).unwrap();
    assert!(
        meta_matches_ignoring_data_blocks(&rec.snaps[expected_snap], &obs),
        "{damage:?}: recovered tree is not the state after transaction {prev_tid}: {}",
        diff(&rec.snaps[expected_snap].canonical(), &obs.canonical())
    );
    // And it is no other state of the run (the damage really cut the log there).
    let later = rec.snaps.len() - 1;
    assert!(!meta_matches_ignoring_data_blocks(&rec.snaps[later], &obs));
    fs.unmount().unwrap();
    drop(fs);
    // e2fsck is not asked to be clean: losing committed transactions loses the
    // frees that let later transactions reuse blocks in place (a long symlink's
    // block may now hold another file's data), as with the kernel after the same
    // damage. Its verdict is shown.
    let scratch = ScratchFile::new("corrupt");
    match fsck_image(&dev.contents(), &scratch, "after recovery of a damaged log") {
        Ok(()) => println!("  e2fsck -fn: clean"),
        Err(e) => println!("  {e}"),
    }
}

#[test]
fn bad_descriptor_checksum_stops_recovery() {
    damaged_log(Damage::DescriptorChecksum, "namespace", 41, 1024);
    damaged_log(Damage::DescriptorChecksum, "mixed", 42, 4096);
}

#[test]
fn bad_commit_checksum_stops_recovery() {
    damaged_log(Damage::CommitChecksum, "namespace", 43, 1024);
    damaged_log(Damage::CommitChecksum, "xattr", 44, 4096);
}

#[test]
fn wrong_sequence_in_a_later_transaction_stops_recovery() {
    damaged_log(Damage::WrongSequence, "mixed", 45, 1024);
    damaged_log(Damage::WrongSequence, "namespace", 46, 4096);
}
