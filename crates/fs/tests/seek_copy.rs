//! lseek SEEK_DATA/SEEK_HOLE and copy_file_range through the library (issue
//! #11): what the kernel comparison (crates/cli/tests/semantics.rs) cannot pin
//! down exactly — unwritten extents count as holes (the kernel's answer there
//! depends on its page cache) — and the copy's sparseness and zero-filling.

use commitfs_fs::testutil::{fsck, mkfs, problem_lines};
use commitfs_fs::*;

const KEEP: FallocFlags = FallocFlags {
    keep_size: true,
    punch_hole: false,
    zero_range: false,
};

fn no_such_offset<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(FsError::NoSuchOffset))
}

#[test]
fn seek_treats_unwritten_extents_as_holes() {
    let img = mkfs("seek", 32, &["-b", "4096"]);
    let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, &[7u8; 4096]).unwrap();
    fs.fallocate(f, 8192, 8192, KEEP).unwrap();
    fs.setattr(
        f,
        &SetAttr {
            size: Some(20_000),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(fs.seek_data_hole(f, 0, true).unwrap(), 0);
    assert_eq!(fs.seek_data_hole(f, 0, false).unwrap(), 4096);
    // Only unwritten blocks and holes follow: no data, a hole at once.
    assert!(no_such_offset(fs.seek_data_hole(f, 4096, true)));
    assert_eq!(fs.seek_data_hole(f, 9000, false).unwrap(), 9000);
    // At or past the end: ENXIO for both.
    assert!(no_such_offset(fs.seek_data_hole(f, 20_000, true)));
    assert!(no_such_offset(fs.seek_data_hole(f, 20_000, false)));
    // Writing into the unwritten extent makes that block data.
    fs.write(f, 8192, &[9u8; 100]).unwrap();
    assert_eq!(fs.seek_data_hole(f, 4096, true).unwrap(), 8192);
    assert_eq!(fs.seek_data_hole(f, 8192, false).unwrap(), 12288);
    assert_eq!(fs.seek_data_hole(f, 12288, false).unwrap(), 12288);
    assert!(no_such_offset(fs.seek_data_hole(f, 12288, true)));
    fs.unmount().unwrap();
}

#[test]
fn copy_file_range_keeps_holes_and_zero_fills_over_data() {
    let img = mkfs("copyrange", 64, &["-b", "4096"]);
    let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
    let src = fs.create(ROOT_INO, b"src", 0o644, 0, 0).unwrap().ino;
    let mut want = vec![0u8; 1 << 20];
    for (off, seed) in [(0usize, 1u8), (512 << 10, 2), ((1 << 20) - 100, 3)] {
        let n = 4096.min((1 << 20) - off);
        let d: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_add(seed) | 1).collect();
        fs.write(src, off as u64, &d).unwrap();
        want[off..off + n].copy_from_slice(&d);
    }
    // Whole file into a new file: same bytes, and the holes stay holes.
    let dst = fs.create(ROOT_INO, b"dst", 0o644, 0, 0).unwrap().ino;
    assert_eq!(
        fs.copy_file_range(src, 0, dst, 0, 2 << 20, None).unwrap(),
        1 << 20
    );
    let mut got = vec![0u8; 1 << 20];
    assert_eq!(fs.read(dst, 0, &mut got).unwrap(), 1 << 20);
    assert!(got == want, "copied bytes differ");
    let (a, b) = (fs.getattr(src).unwrap(), fs.getattr(dst).unwrap());
    assert_eq!(b.size, a.size);
    assert_eq!(b.blocks, a.blocks, "the copy allocated the source's holes");
    // Into the middle of a file full of other data: the source's hole reads as
    // zeros there.
    let mixed = fs.create(ROOT_INO, b"mixed", 0o644, 0, 0).unwrap().ino;
    fs.write(mixed, 0, &vec![0xeeu8; 64 << 10]).unwrap();
    assert_eq!(
        fs.copy_file_range(src, 2048, mixed, 1000, 20_000, None)
            .unwrap(),
        20_000
    );
    let mut m = vec![0u8; 64 << 10];
    fs.read(mixed, 0, &mut m).unwrap();
    assert!(m[..1000].iter().all(|&b| b == 0xee));
    assert_eq!(&m[1000..21_000], &want[2048..22_048]);
    assert!(m[21_000..].iter().all(|&b| b == 0xee));
    // From the end of the source: nothing; overlapping ranges of one file: EINVAL.
    assert_eq!(
        fs.copy_file_range(src, 1 << 20, dst, 0, 10, None).unwrap(),
        0
    );
    assert!(matches!(
        fs.copy_file_range(src, 0, src, 100, 1000, None),
        Err(FsError::Invalid(_))
    ));
    fs.unmount().unwrap();
    drop(fs);
    let r = fsck(&img.path);
    assert!(r.is_clean(), "{:?}\n{}", problem_lines(&r.output), r.output);
}
