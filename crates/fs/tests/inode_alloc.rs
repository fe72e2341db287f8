//! Inode numbers freed by a transaction that is not committed yet are not
//! reused (alloc.rs, `pending_free_inodes`, like the kernel's recently deleted
//! inodes); once it commits they are, from the lowest. Creates and unlinks
//! without a commit, past a whole group's inodes, neither fail nor reuse a
//! pending number.

use std::collections::BTreeSet;

use commitfs_fs::testutil::{assert_fsck_clean, mkfs};
use commitfs_fs::*;

#[test]
fn freed_inode_numbers_wait_for_their_commit_then_are_reused_lowest_first() {
    // 1 KiB blocks, 8 groups of 256 inodes.
    let img = mkfs("ialloc", 16, &["-b", "1024", "-N", "2048"]);
    {
        let fs = Fs::open_path(
            &img.path,
            MountOptions {
                commit_interval: 0,
                ..Default::default()
            },
        )
        .unwrap();
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
