//! Inode numbers freed by a transaction that is not committed yet are not
//! reused (alloc.rs, `pending_free_inodes`, like the kernel's recently deleted
//! inodes); once it commits they are, from the lowest. Creates and unlinks
//! without a commit, past a whole group's inodes, neither fail nor reuse a
//! pending number.

use std::collections::BTreeSet;

use commitfs_fs::testutil::{assert_fsck_clean, mkfs};
use commitfs_fs::*;

/// Mounted with no periodic commit: only the test's fsyncs and syncs
/// commit (and the fast-commit area filling).
fn open_without_periodic_commits(path: &std::path::Path) -> Fs {
    Fs::open_path(
        path,
        MountOptions {
            commit_interval: 0,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn freed_inode_numbers_wait_for_their_commit_then_are_reused_lowest_first() {
    // 1 KiB blocks, 8 groups of 256 inodes.
    let img = mkfs("ialloc", 16, &["-b", "1024", "-N", "2048"]);
    {
        let fs = open_without_periodic_commits(&img.path);
        let ipg = (fs.statfs().unwrap().files / 8) as u32;
        assert_eq!(ipg, 256, "the test wants 8 groups of 256 inodes");
        // More create/unlink pairs than group 0 has inodes, in one transaction.
        let mut seen = BTreeSet::new();
        for i in 0..300 {
            let name = format!("f{i}");
            let a = fs.create(ROOT_INO, name.as_bytes(), 0o644, 0, 0).unwrap();
            assert!(
                seen.insert(a.ino),
                "inode {} reused before the unlink that freed it committed",
                a.ino
            );
            fs.unlink(ROOT_INO, name.as_bytes()).unwrap();
        }
        let lowest = *seen.first().unwrap();
        assert!(
            seen.iter().any(|&i| i > ipg),
            "group 0's pending numbers pushed allocation to another group"
        );
        // Committed: the freed numbers are reusable, the lowest first.
        fs.sync().unwrap();
        let a = fs.create(ROOT_INO, b"after", 0o644, 0, 0).unwrap();
        assert_eq!(a.ino, lowest, "the lowest freed number is reused first");
        fs.unmount().unwrap();
    }
    assert_fsck_clean(&img.path);
}

/// Blocks freed by a transaction that is not committed yet are not reused
/// (`pending.rs`: the allocator reads the group's bitmap ORed with the
/// pending bits); once it commits they are. Small pending holes sit at the
/// allocation goal (the group's start), as under varmail between full
/// commits (fast commits do not commit the running transaction).
#[test]
fn freed_blocks_wait_for_their_commit_then_are_reused() {
    let img = mkfs("balloc", 32, &["-b", "1024", "-O", "fast_commit"]);
    {
        let fs = open_without_periodic_commits(&img.path);
        let commits = || fs.stats().journal.commits;
        let data = vec![7u8; 3 * 1024];
        // Blocks freed since the last full commit completed, and that count.
        let mut pending: (u64, BTreeSet<u64>) = (commits(), BTreeSet::new());
        let mut all_freed: BTreeSet<u64> = BTreeSet::new();
        let (mut checked, mut reused) = (0, 0);
        // Files of 3 blocks, every other one removed: holes of 3 blocks
        // between live files.
        for i in 0..300 {
            let name = format!("k{i}");
            let a = fs.create(ROOT_INO, name.as_bytes(), 0o644, 0, 0).unwrap();
            fs.write(a.ino, 0, &data).unwrap();
            fs.fsync(a.ino, false).unwrap();
            let blocks = fs.mapped_blocks(a.ino).unwrap();
            assert_eq!(blocks.len(), 3);
            if commits() != pending.0 {
                // A full commit ended during this fsync: every earlier free
                // is durable and its blocks may be reused.
                pending = (commits(), BTreeSet::new());
            } else {
                for b in &blocks {
                    assert!(
                        !pending.1.contains(b),
                        "block {b} reused before the unlink that freed it committed"
                    );
                    checked += 1;
                }
            }
            reused += blocks.iter().filter(|b| all_freed.contains(*b)).count();
            if i % 2 == 0 {
                fs.unlink(ROOT_INO, name.as_bytes()).unwrap();
                pending.1.extend(&blocks);
                all_freed.extend(&blocks);
            }
        }
        assert!(checked >= 300, "only {checked} allocations checked");
        // After full commits (the fast-commit area fills), the freed holes
        // at the goal are allocated again.
        assert!(
            reused >= 100,
            "only {reused} of {} freed blocks were reused after their commit",
            all_freed.len()
        );
        fs.unmount().unwrap();
    }
    assert_fsck_clean(&img.path);
}
