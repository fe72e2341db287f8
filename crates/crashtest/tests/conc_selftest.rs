//! The concurrent checker must be able to fail: an acknowledged transaction's
//! commit block dropped, foreign data planted in a file, and a recovered state
//! that breaks real-time order across threads are each reported, while the same
//! states without the damage pass.

use commitfs_crashtest::concurrent::{check_conc_image, record_for, ConcConfig, ConcRecording};
use commitfs_crashtest::jlog::journal_blocks;
use commitfs_crashtest::ScratchFile;
use commitfs_format::jbd2::BLOCKTYPE_COMMIT;

fn recording(workload: &str, seed: u64) -> ConcRecording {
    record_for(&ConcConfig {
        workload: workload.into(),
        seed,
        ..ConcConfig::default()
    })
    .unwrap()
}

#[test]
fn dropping_an_acknowledged_commit_block_is_reported() {
    let rec = recording("varmail-shared-8", 31);
    let scratch = ScratchFile::new("conc-selftest");
    let blocks = journal_blocks(&rec.log, rec.bs, rec.log.len());
    let mut tried = 0;
    'outer: for tr in &rec.threads {
        for a in &tr.acks {
            let k = a.ret_idx;
            // The commit block this fsync waited for (none if it was covered).
            let Some(commit) = blocks.iter().rev().find(|b| {
                b.blocktype == BLOCKTYPE_COMMIT && b.log_idx >= a.start_idx && b.log_idx < k
            }) else {
                continue;
            };
            // Only when its own operations are in that transaction: the last op the
            // fsync covers started after the previous commit block.
            if a.covers == 0 {
                continue;
            }
            let honest = rec.log.full_image(k);
            check_conc_image(&rec, honest, k, &scratch)
                .0
                .unwrap_or_else(|e| panic!("honest state at k={k} failed: {e}"));
            let broken = rec.log.image_filtered(k, |i, _| i != commit.log_idx);
            match check_conc_image(&rec, broken, k, &scratch).0 {
                Err(e) => {
                    assert!(e.starts_with("(b)"), "{e}");
                    println!("lost commit block at log index {}: {e}", commit.log_idx);
                    tried += 1;
                }
                // The covered operations were in an earlier transaction already.
                Ok(_) => continue,
            }
            if tried == 3 {
                break 'outer;
            }
        }
    }
    assert_eq!(tried, 3, "not enough fsyncs whose loss is visible");
}

#[test]
fn foreign_data_in_a_file_is_reported() {
    let rec = recording("fsmark-8", 32);
    let scratch = ScratchFile::new("conc-selftest");
    let k = rec.log.len();
    let img = rec.log.full_image(k);
    check_conc_image(&rec, img.clone(), k, &scratch)
        .0
        .unwrap_or_else(|e| panic!("honest final state failed: {e}"));
    // A full block of thread 0's first file, overwritten with thread 1's data.
    let bs = rec.bs;
    let last = |t: usize| rec.threads[t].states.last().unwrap().clone();
    let (a, b) = (last(0), last(1));
    let fa = a
        .values()
        .find(|f| f.data.len() >= bs)
        .expect("a full block");
    let fb = b
        .values()
        .find(|f| f.data.len() >= bs)
        .expect("a full block");
    let at = img
        .chunks(bs)
        .position(|c| c == &fa.data[..bs])
        .expect("the block on the device")
        * bs;
    let mut broken = img;
    broken[at..at + bs].copy_from_slice(&fb.data[..bs]);
    let e = check_conc_image(&rec, broken, k, &scratch)
        .0
        .expect_err("foreign data must be reported");
    assert!(e.contains("(c)") && e.contains("stale or foreign"), "{e}");
    println!("{e}");
}

#[test]
fn real_time_order_across_threads_is_enforced() {
    let mut rec = recording("varmail-split-8", 33);
    let scratch = ScratchFile::new("conc-selftest");
    // An honest mid-run state where two threads recovered different prefixes.
    let mut found = None;
    for k in rec.log.flush_indices().into_iter().map(|f| f + 1).rev() {
        if k < rec.workload_start + 200 {
            break;
        }
        let img = rec.log.full_image(k);
        let p = check_conc_image(&rec, img, k, &scratch)
            .0
            .unwrap_or_else(|e| panic!("honest state at k={k} failed: {e}"));
        let hi = |t: usize| rec.threads[t].window(k).1;
        if let Some(u) = (0..rec.threads.len()).find(|&u| p.prefixes[u] < hi(u) && hi(u) > 0) {
            if (0..rec.threads.len()).any(|t| t != u && p.prefixes[t] > 0) {
                found = Some((k, u, p.prefixes[u]));
                break;
            }
        }
    }
    let (k, u, pu) = found.expect("a state with an operation in progress");
    // Pretend thread u's next operation (not recovered) returned before any other
    // operation began: every surviving operation of the others then demands it.
    for o in &mut rec.threads[u].ops[..=pu] {
        o.start_seq = 0;
        o.end_seq = 0;
    }
    // Keep the window: the op may or may not be there as far as (a)/(b) go.
    let e = check_conc_image(&rec, rec.log.full_image(k), k, &scratch)
        .0
        .expect_err("a lost operation that returned before a surviving one must be reported");
    assert!(e.starts_with("(f)"), "{e}");
    println!("{e}");
}
