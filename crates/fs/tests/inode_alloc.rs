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
/// pending bits); once it commits they are. Pending holes sit at the
/// allocation goal (the group's start), as under varmail between full
/// commits (fast commits do not commit the running transaction). Files of
/// 17 blocks: just over the small-file stream's limit (`alloc_goal`), so
/// that their goal is their group's start.
#[test]
fn freed_blocks_wait_for_their_commit_then_are_reused() {
    let img = mkfs("balloc", 32, &["-b", "1024", "-O", "fast_commit"]);
    {
        let fs = open_without_periodic_commits(&img.path);
        let commits = || fs.stats().journal.commits;
        const BLOCKS: usize = 17;
        let data = vec![7u8; BLOCKS * 1024];
        // Blocks freed since the last full commit completed, and that count.
        let mut pending: (u64, BTreeSet<u64>) = (commits(), BTreeSet::new());
        let mut all_freed: BTreeSet<u64> = BTreeSet::new();
        let (mut checked, mut reused) = (0, 0);
        // Files of 17 blocks, every other one removed: holes of 17 blocks
        // between live files.
        for i in 0..300 {
            let name = format!("k{i}");
            let a = fs.create(ROOT_INO, name.as_bytes(), 0o644, 0, 0).unwrap();
            fs.write(a.ino, 0, &data).unwrap();
            fs.fsync(a.ino, false).unwrap();
            let blocks = fs.mapped_blocks(a.ino).unwrap();
            assert_eq!(blocks.len(), BLOCKS);
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

/// Small files (up to 16 blocks, ext4's `mb_stream_req`) take their blocks
/// from one stream shared by all of them (file.rs `Inner::alloc_goal`,
/// after mballoc's locality groups): the files one commit writes lie
/// together on the device even where freed one-block holes sit at their
/// group's start (their goal without the stream), and the commit writes
/// their data in one device write (writeback.rs `write_runs` joins runs
/// that meet on the device).
#[test]
fn small_files_of_one_commit_lie_together_and_go_in_one_write() {
    let img = mkfs("stream", 32, &["-b", "4096"]);
    {
        let fs = open_without_periodic_commits(&img.path);
        let block = vec![5u8; 4096];
        // One-block holes between live files, committed (free for reuse).
        for i in 0..64 {
            let a = fs
                .create(ROOT_INO, format!("h{i}").as_bytes(), 0o644, 0, 0)
                .unwrap();
            fs.write(a.ino, 0, &block).unwrap();
        }
        fs.sync().unwrap();
        for i in (0..64).step_by(2) {
            fs.unlink(ROOT_INO, format!("h{i}").as_bytes()).unwrap();
        }
        fs.sync().unwrap();
        // Sixteen small files written through the cache, one commit.
        let mut inos = Vec::new();
        for i in 0..16u8 {
            let a = fs
                .create(ROOT_INO, format!("s{i}").as_bytes(), 0o644, 0, 0)
                .unwrap();
            fs.write(a.ino, 0, &vec![i; 4096]).unwrap();
            inos.push(a.ino);
        }
        let before = fs.io_stats();
        fs.sync().unwrap();
        let after = fs.io_stats();
        let mut blocks: Vec<u64> = Vec::new();
        for &ino in &inos {
            let b = fs.mapped_blocks(ino).unwrap();
            assert_eq!(b.len(), 1, "inode {ino}: {b:?}");
            blocks.extend(b);
        }
        blocks.sort_unstable();
        let first = blocks[0];
        assert!(
            blocks
                .iter()
                .enumerate()
                .all(|(k, &b)| b == first + k as u64),
            "the small files of one commit are not contiguous: {blocks:?}"
        );
        let writes = after.data.writes - before.data.writes;
        assert_eq!(
            writes, 1,
            "sixteen contiguous small files took {writes} data writes"
        );
        for (i, &ino) in inos.iter().enumerate() {
            let mut buf = vec![0u8; 4096];
            assert_eq!(fs.read(ino, 0, &mut buf).unwrap(), 4096);
            assert!(
                buf.iter().all(|&x| x == i as u8),
                "file s{i} reads back wrong"
            );
        }
        fs.unmount().unwrap();
    }
    assert_fsck_clean(&img.path);
}
