//! The checker must be able to fail: broken crash states built on purpose (a
//! committed block dropped, foreign or stale data planted into a file, non-zero
//! bytes where the file reads zeros) are reported, while the same states without
//! the damage pass.

use commitfs_crashtest::check::check_image_in;
use commitfs_crashtest::jlog::journal_blocks;
use commitfs_crashtest::model::Kind;
use commitfs_crashtest::{base_image, find, record, Recording, ScratchFile};
use commitfs_format::jbd2::BLOCKTYPE_COMMIT;

fn recording(workload: &str, seed: u64) -> Recording {
    let base = base_image(1024).unwrap();
    record(find(workload).unwrap(), &base, seed).unwrap()
}

#[test]
fn dropping_a_committed_commit_block_is_reported() {
    let rec = recording("mixed", 21);
    let scratch = ScratchFile::new("selftest");
    let blocks = journal_blocks(&rec.log, rec.bs, rec.log.len());
    let mut tried = 0;
    for s in rec.syncs.iter().filter(|s| s.what != "unmount") {
        let k = s.ret_idx;
        let (lo, hi) = rec.window(k);
        assert_eq!(lo, s.model_idx);
        // The commit block this fsync wrote (none if it had nothing to commit).
        let Some(commit) = blocks
            .iter()
            .rev()
            .find(|b| b.blocktype == BLOCKTYPE_COMMIT && b.log_idx >= s.start_idx && b.log_idx < k)
        else {
            continue;
        };
        // Only a transaction that changed the tree makes a visible difference.
        let before = rec.window(commit.log_idx).0;
        if rec.snap_hashes[before] == rec.snap_hashes[lo] {
            continue;
        }
        // Control: the honest state passes.
        let honest = rec.log.full_image(k);
        check_image_in(&rec, honest, (lo, hi, hi), &[], &scratch)
            .0
            .unwrap_or_else(|e| panic!("honest state at k={k} failed: {e}"));
        // The same state with the acknowledged commit block lost.
        let broken = rec.log.image_filtered(k, |i, _| i != commit.log_idx);
        let err = check_image_in(&rec, broken, (lo, hi, hi), &[], &scratch)
            .0
            .expect_err("a lost commit block of an acknowledged fsync must be reported");
        assert!(err.starts_with("(b)"), "{err}");
        println!("lost commit block at log index {}: {err}", commit.log_idx);
        tried += 1;
        if tried == 3 {
            break;
        }
    }
    assert_eq!(tried, 3, "not enough fsyncs with visible transactions");
}

/// The final image of a run (clean unmount: everything home) and its snapshot.
fn final_state(rec: &Recording) -> (Vec<u8>, usize) {
    (rec.log.full_image(rec.log.len()), rec.snaps.len() - 1)
}

/// Device offset of the block holding exactly `data`.
fn locate(img: &[u8], data: &[u8]) -> Option<usize> {
    img.chunks(data.len())
        .position(|c| c == data)
        .map(|i| i * data.len())
}

#[test]
fn foreign_stale_and_nonzero_data_are_reported() {
    let rec = recording("data", 22);
    let scratch = ScratchFile::new("selftest");
    let bs = rec.bs;
    let (img, last) = final_state(&rec);
    check_image_in(&rec, img.clone(), (last, last, last), &[], &scratch)
        .0
        .unwrap_or_else(|e| panic!("honest final state failed: {e}"));
    let snap = &rec.snaps[last];
    // Full data blocks of regular files: (file id, block index, data).
    let mut full = Vec::new();
    for id in snap.paths.values() {
        let ino = &snap.inodes[id];
        if ino.meta.kind != Kind::File {
            continue;
        }
        for (b, blk) in ino.blocks.iter().enumerate() {
            if let Some(blk) = blk {
                if (b as u64 + 1) * bs as u64 <= ino.meta.size {
                    full.push((*id, b, blk.clone()));
                }
            }
        }
    }
    assert!(full.len() > 10, "the data workload must leave data blocks");

    // Foreign: file A's block replaced by file B's block.
    let (a_id, _, a_blk) = &full[0];
    let (_, _, b_blk) = full.iter().find(|(id, _, _)| id != a_id).unwrap();
    let pos = locate(&img, &a_blk.data).expect("file block on disk");
    let mut bad = img.clone();
    bad[pos..pos + bs].copy_from_slice(&b_blk.data);
    let err = check_image_in(&rec, bad, (last, last, last), &[], &scratch)
        .0
        .expect_err("foreign data must be reported");
    assert!(err.starts_with("(c)") && err.contains("foreign"), "{err}");
    assert!(err.contains("the data is file id"), "{err}");
    println!("foreign: {err}");

    // Stale: a block replaced by an older version of itself.
    let mut planted_stale = false;
    'outer: for (id, b, blk) in &full {
        for s in rec.snaps[..last].iter().rev() {
            let Some(old) = s.inodes.get(id).and_then(|i| i.block(*b)) else {
                continue;
            };
            if old.data != blk.data && old.data.iter().all(|&x| x != 0) {
                let pos = locate(&img, &blk.data).expect("file block on disk");
                let mut bad = img.clone();
                bad[pos..pos + bs].copy_from_slice(&old.data);
                let err = check_image_in(&rec, bad, (last, last, last), &[], &scratch)
                    .0
                    .expect_err("stale data must be reported");
                assert!(err.starts_with("(c)"), "{err}");
                println!("stale: {err}");
                planted_stale = true;
                break 'outer;
            }
        }
    }
    assert!(planted_stale, "no block with an older version found");

    // Non-zero bytes where every version reads zeros (e.g. the zeroed tail of a
    // truncated or punched block).
    let (pos, byte) = full
        .iter()
        .find_map(|(_, _, blk)| {
            // A run of 64 zeros is a zeroed range, not chance zeros in the data.
            let z = blk
                .data
                .windows(64)
                .position(|w| w.iter().all(|&x| x == 0))?;
            let nz = blk.data.iter().filter(|&&x| x != 0).count();
            (nz > bs / 4).then(|| (locate(&img, &blk.data).expect("on disk"), z + 32))
        })
        .expect("a partly zero block");
    let mut bad = img.clone();
    bad[pos + byte] = 0x5A;
    let err = check_image_in(&rec, bad, (last, last, last), &[], &scratch)
        .0
        .expect_err("non-zero data in a zero range must be reported");
    assert!(err.contains("every allowed version reads zeros"), "{err}");
    println!("non-zero: {err}");
}

#[test]
fn a_state_outside_the_window_is_reported() {
    // The final state checked against an older window only: the recovered tree
    // is newer than anything allowed.
    let rec = recording("namespace", 23);
    let scratch = ScratchFile::new("selftest");
    let (img, last) = final_state(&rec);
    let old = last / 2;
    let err = check_image_in(&rec, img, (0, old, old), &[], &scratch)
        .0
        .expect_err("a tree newer than the window must be reported");
    assert!(
        err.starts_with("(b)") && err.contains("it equals snapshot"),
        "{err}"
    );
    println!("outside the window: {}", &err[..err.len().min(200)]);
}

/// fdatasync's promise (C.5) is checked per file: a state that lost the data
/// an acknowledged fdatasync made durable — here the image from before the
/// write, whose tree the fdatasync's window still allows — is reported, while
/// the same image passes as the crash state it honestly is.
#[test]
fn data_lost_after_an_fdatasync_is_reported() {
    let scratch = ScratchFile::new("selftest");
    let mut tried = 0;
    for seed in 1..40 {
        let rec = recording("data", seed);
        for s in rec.syncs.iter() {
            let Some(id) = s.data_of else { continue };
            // The last operation before the fdatasync that changed the file's bytes.
            let changed = (0..s.model_idx).rev().find(|&i| {
                let (a, b) = (rec.snaps[i].inodes.get(&id), rec.snaps[i + 1].inodes.get(&id));
                matches!((a, b), (Some(a), Some(b)) if a.blocks != b.blocks && a.meta.size == b.meta.size)
            });
            let Some(i) = changed else { continue };
            let k0 = rec.op_start[i];
            let img = rec.log.full_image(k0);
            // Honest: a crash at k0.
            commitfs_crashtest::check_image(&rec, img.clone(), k0, &scratch)
                .unwrap_or_else(|e| panic!("honest state at k={k0} failed: {e}"));
            // The same image after the fdatasync returned, with only its promise
            // added to the window the image satisfies.
            let lo = rec.window(k0).0;
            let hi = rec.window(s.ret_idx).1;
            let err = check_image_in(&rec, img, (lo, hi, hi), &[(id, s.model_idx)], &scratch)
                .0
                .expect_err("data older than an acknowledged fdatasync must be reported");
            assert!(err.starts_with("(c)"), "{err}");
            println!("{}: {err}", s.what);
            tried += 1;
            break;
        }
        if tried == 3 {
            break;
        }
    }
    assert_eq!(tried, 3, "not enough fdatasyncs after in-place overwrites");
}
