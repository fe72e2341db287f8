//! One user per image (`FileDevice::open`): a second writer is refused with a
//! message naming the first, readers share, loop devices backed by an image and
//! exclusively opened block devices count as users, and immutable files are named.
//! Needs root (losetup, chattr) like the rest of the project's tests.

use std::path::{Path, PathBuf};
use std::process::Command;

use commitfs_device::testutil::{Image, Loop};
use commitfs_device::{BlockDevice, DeviceError, FileDevice, IoCategory, OtherUser};

fn in_use(r: Result<FileDevice, DeviceError>) -> (Vec<OtherUser>, String) {
    match r {
        Err(e @ DeviceError::InUse { .. }) => {
            let msg = e.to_string();
            let DeviceError::InUse { users, .. } = e else {
                unreachable!()
            };
            (users, msg)
        }
        Err(e) => panic!("expected InUse, got {e}"),
        Ok(_) => panic!("expected InUse, the open succeeded"),
    }
}

#[test]
fn a_second_writer_is_refused_and_named_readers_share() {
    let img = Image::new("lock", 1 << 20);
    let me = std::process::id();
    {
        let w = FileDevice::open(&img.0, false).unwrap();
        // Another writer, and a reader, beside the writer: refused, naming us.
        for ro in [false, true] {
            let (users, msg) = in_use(FileDevice::open(&img.0, ro));
            assert!(
                users
                    .iter()
                    .any(|u| matches!(u, OtherUser::Process { pid: Some(p), .. } if *p == me)),
                "{users:?}"
            );
            assert!(msg.contains(&format!("held by process {me}")), "{msg}");
            assert!(msg.contains(&img.0.display().to_string()), "{msg}");
        }
        // The probe sees the writer and takes nothing.
        let users = FileDevice::users(&img.0).unwrap();
        assert_eq!(users.len(), 1, "{users:?}");
        w.write_at(0, b"still mine", IoCategory::Data, true)
            .unwrap();
    }
    // Released with the device: readers share, and keep writers out.
    assert!(FileDevice::users(&img.0).unwrap().is_empty());
    let r1 = FileDevice::open(&img.0, true).unwrap();
    let r2 = FileDevice::open(&img.0, true).unwrap();
    in_use(FileDevice::open(&img.0, false));
    assert_eq!(FileDevice::users(&img.0).unwrap().len(), 1);
    drop((r1, r2));
    let w = FileDevice::open(&img.0, false).unwrap();
    let mut b = [0u8; 10];
    w.read_at(0, &mut b, IoCategory::Data).unwrap();
    assert_eq!(&b, b"still mine");
}

#[test]
fn the_lock_is_seen_by_another_process() {
    // An OFD lock (F_OFD_SETLK = 37) held by another process: util-linux's
    // flock(1) takes flock locks only, a python one-liner can take this one.
    let img = Image::new("child", 1 << 20);
    let script = format!(
        "import fcntl,os,struct,sys,time\n\
         f=os.open({:?},os.O_RDWR)\n\
         fcntl.fcntl(f,37,struct.pack('hhqqi',fcntl.F_WRLCK,0,0,0,0))\n\
         print('locked',flush=True)\n\
         sys.stdin.read()\n",
        img.0.display().to_string()
    );
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 (the lock holder)");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "locked");
    let r = FileDevice::open(&img.0, false);
    drop(child.stdin.take());
    let _ = child.wait();
    let (users, msg) = in_use(r);
    assert_eq!(
        users,
        vec![OtherUser::Process {
            pid: Some(child.id()),
            name: Some("python3".into())
        }],
        "{msg}"
    );
    // Gone with its process.
    FileDevice::open(&img.0, false).unwrap();
}

#[test]
fn a_loop_device_backed_by_the_image_is_a_user() {
    let img = Image::new("loop", 8 << 20);
    {
        let lo = Loop::attach(&img.0, false);
        let (users, msg) = in_use(FileDevice::open(&img.0, false));
        assert_eq!(
            users,
            vec![OtherUser::LoopDevice {
                dev: PathBuf::from(&lo.0),
                read_only: false
            }]
        );
        assert!(msg.contains(&format!("losetup -d {}", lo.0)), "{msg}");
        // Reading beside an unmounted loop device is harmless.
        FileDevice::open(&img.0, true).unwrap();
        assert_eq!(FileDevice::users(&img.0).unwrap().len(), 1);
    }
    FileDevice::open(&img.0, false).unwrap();
}

#[test]
fn block_devices_are_opened_exclusively() {
    let img = Image::new("blk", 16 << 20);
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&img.0)
        .output()
        .unwrap();
    assert!(out.status.success());
    let lo = Loop::attach(&img.0, false);
    let dev = FileDevice::open(Path::new(&lo.0), false).unwrap();
    // A second writer, a reader, and the kernel, are refused while we hold it.
    in_use(FileDevice::open(Path::new(&lo.0), false));
    in_use(FileDevice::open(Path::new(&lo.0), true));
    assert!(!FileDevice::users(Path::new(&lo.0)).unwrap().is_empty());
    let dir = commitfs_device::testutil::unique("blkmnt");
    std::fs::create_dir(&dir).unwrap();
    let m = Command::new("mount")
        .args(["-t", "ext4"])
        .arg(&lo.0)
        .arg(&dir)
        .output()
        .unwrap();
    if m.status.success() {
        let _ = Command::new("umount").arg(&dir).status();
        let _ = std::fs::remove_dir(&dir);
        panic!("the kernel mounted a device commitfs holds exclusively");
    }
    drop(dev);
    // Released: the kernel may mount it, and then we are refused, naming the mount.
    let m = Command::new("mount")
        .args(["-t", "ext4"])
        .arg(&lo.0)
        .arg(&dir)
        .output()
        .unwrap();
    assert!(m.status.success(), "{}", String::from_utf8_lossy(&m.stderr));
    let r = FileDevice::open(Path::new(&lo.0), false);
    let ro = FileDevice::open(Path::new(&lo.0), true);
    let _ = Command::new("umount").arg(&dir).status();
    let _ = std::fs::remove_dir(&dir);
    let (users, msg) = in_use(r);
    assert!(
        matches!(&users[..], [OtherUser::Mounted { dir: d, fstype, .. }] if *d == dir && fstype == "ext4"),
        "{users:?}"
    );
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    // Reading beside a read-write mount is refused too ...
    in_use(ro);
    // ... and allowed beside a read-only one.
    std::fs::create_dir(&dir).unwrap();
    let m = Command::new("mount")
        .args(["-t", "ext4", "-o", "ro"])
        .arg(&lo.0)
        .arg(&dir)
        .output()
        .unwrap();
    assert!(m.status.success(), "{}", String::from_utf8_lossy(&m.stderr));
    let ro = FileDevice::open(Path::new(&lo.0), true);
    let rw = FileDevice::open(Path::new(&lo.0), false);
    let _ = Command::new("umount").arg(&dir).status();
    let _ = std::fs::remove_dir(&dir);
    ro.expect("read-only beside a read-only kernel mount");
    let (users, _) = in_use(rw);
    assert!(
        matches!(
            &users[..],
            [OtherUser::Mounted {
                read_only: true,
                ..
            }]
        ),
        "{users:?}"
    );
}

#[test]
fn an_immutable_image_is_named_on_open() {
    let img = Image::new("immutable", 1 << 20);
    let st = Command::new("chattr")
        .arg("+i")
        .arg(&img.0)
        .status()
        .unwrap();
    assert!(st.success(), "chattr +i");
    match FileDevice::open(&img.0, false) {
        Err(e @ DeviceError::Attribute { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("immutable"), "{msg}");
            assert!(msg.contains("-o ro"), "{msg}");
        }
        Err(e) => panic!("expected the immutable attribute to be named, got {e}"),
        Ok(_) => panic!("opened an immutable file for writing"),
    }
    // Read-only works.
    FileDevice::open(&img.0, true).unwrap();
}

/// On a block device, large page-aligned reads and writes bypass the page
/// cache (O_DIRECT) and small ones go through it: mixed on the same blocks, in
/// every order, each read sees the last write, and so does the image file.
#[test]
fn direct_and_buffered_io_on_a_block_device_agree() {
    const MIB: usize = 1 << 20;
    let img = Image::new("dio", 16 << 20);
    let lo = Loop::attach(&img.0, false);
    let dev = FileDevice::open(Path::new(&lo.0), false).unwrap();
    let fill = |seed: u8, len: usize| -> Vec<u8> {
        (0..len)
            .map(|i| seed.wrapping_add((i / 4096) as u8))
            .collect()
    };
    // Unaligned heap buffers too: a Vec is not page-aligned in general.
    let mut big = vec![0u8; MIB + 1];
    // 1. Buffered small writes, then a direct large write over them.
    dev.write_at(MIB as u64, &fill(1, 4096), IoCategory::Metadata, false)
        .unwrap();
    dev.write_at(
        MIB as u64 + 8192,
        &fill(2, 4096),
        IoCategory::Metadata,
        false,
    )
    .unwrap();
    let a = fill(3, MIB);
    big[1..].copy_from_slice(&a);
    dev.write_at(MIB as u64, &big[1..], IoCategory::Data, false)
        .unwrap();
    let mut small = vec![0u8; 4096];
    dev.read_at(MIB as u64 + 8192, &mut small, IoCategory::Metadata)
        .unwrap();
    assert_eq!(small, a[8192..12288], "buffered read after a direct write");
    // 2. A buffered small write inside it, then a direct large read.
    let b = fill(9, 4096);
    dev.write_at(MIB as u64 + 4096, &b, IoCategory::Metadata, false)
        .unwrap();
    let mut back = vec![0u8; MIB];
    dev.read_at(MIB as u64, &mut back, IoCategory::Data)
        .unwrap();
    let mut want = a.clone();
    want[4096..8192].copy_from_slice(&b);
    assert_eq!(back, want, "direct read after a buffered write");
    // 3. Durable on the image once flushed.
    dev.flush().unwrap();
    drop(dev);
    drop(lo);
    let on_disk = std::fs::read(&img.0).unwrap();
    assert_eq!(&on_disk[MIB..2 * MIB], &want[..]);
}

/// Write requests and sectors written to a block device so far
/// (`/sys/block/NAME/stat`, fields 5 and 7).
fn loop_stat(dev: &str) -> (u64, u64) {
    let name = Path::new(dev).file_name().unwrap().to_string_lossy();
    let stat = std::fs::read_to_string(format!("/sys/block/{name}/stat")).unwrap();
    let f: Vec<u64> = stat
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (f[4], f[6])
}

/// A FUA write on a block device is one write of its own bytes (a direct
/// write with RWF_DSYNC): the block device's other dirty pages stay where
/// they are, where the old write + fdatasync wrote every one of them back
/// first (a commit block then waited for a checkpoint's buffered writes).
#[test]
fn a_fua_write_on_a_block_device_writes_only_its_own_bytes() {
    const MIB: u64 = 1 << 20;
    let img = Image::new("fua", 16 << 20);
    let lo = Loop::attach(&img.0, false);
    let dev = FileDevice::open(Path::new(&lo.0), false).unwrap();
    assert!(dev.has_true_fua(), "io_uring is available on this machine");
    // 16 buffered 4 KiB writes: 64 KiB dirty in the block device's page cache.
    for b in 0..16u64 {
        dev.write_at(b * 4096, &[b as u8 + 1; 4096], IoCategory::Metadata, false)
            .unwrap();
    }
    let before = loop_stat(&lo.0);
    let commit = [0xC5u8; 4096];
    dev.write_at(8 * MIB, &commit, IoCategory::Journal, true)
        .unwrap();
    let after = loop_stat(&lo.0);
    assert_eq!(
        after.1 - before.1,
        8,
        "a 4 KiB FUA write wrote {} sectors (the dirty buffered pages went with it)",
        after.1 - before.1
    );
    // The loop device counts a flush as a write request: one request means no
    // flush after the FUA write (a synchronous RWF_DSYNC write adds one).
    assert_eq!(after.0 - before.0, 1, "write requests of one FUA write");
    let s = dev.stats().snapshot();
    let j = s.category(IoCategory::Journal);
    assert_eq!((j.writes, j.fua_writes, j.write_bytes), (1, 1, 4096));
    // Both handles see it, and the buffered writes are still there.
    let mut back = vec![0u8; 4096];
    dev.read_at(8 * MIB, &mut back, IoCategory::Journal)
        .unwrap();
    assert_eq!(back, commit);
    dev.read_at(4096, &mut back, IoCategory::Metadata).unwrap();
    assert_eq!(back, [2u8; 4096]);
    // An unaligned buffer and a sub-page length take the same path.
    let mut odd = vec![0u8; 513];
    odd[1..].fill(0x7E);
    dev.write_at(9 * MIB, &odd[1..], IoCategory::Journal, true)
        .unwrap();
    dev.flush().unwrap();
    drop(dev);
    drop(lo);
    let on_disk = std::fs::read(&img.0).unwrap();
    assert_eq!(
        &on_disk[8 * MIB as usize..8 * MIB as usize + 4096],
        &commit[..]
    );
    assert_eq!(
        &on_disk[9 * MIB as usize..9 * MIB as usize + 512],
        &[0x7E; 512][..]
    );
    assert_eq!(&on_disk[4096..8192], &[2u8; 4096][..]);
}

/// On an image file a FUA write (RWF_DSYNC on the buffered handle) lands and
/// is counted as one.
#[test]
fn a_fua_write_on_an_image_file_lands() {
    let img = Image::new("fuafile", 4 << 20);
    let dev = FileDevice::open(&img.0, false).unwrap();
    dev.write_at(4096, &[3u8; 4096], IoCategory::Data, false)
        .unwrap();
    dev.write_at(8192, &[4u8; 4096], IoCategory::Journal, true)
        .unwrap();
    let s = dev.stats().snapshot();
    assert_eq!(s.category(IoCategory::Journal).fua_writes, 1);
    assert_eq!(s.category(IoCategory::Data).fua_writes, 0);
    drop(dev);
    let on_disk = std::fs::read(&img.0).unwrap();
    assert_eq!(&on_disk[8192..12288], &[4u8; 4096][..]);
    assert_eq!(&on_disk[4096..8192], &[3u8; 4096][..]);
}

/// A batch of writes on a block device: the large page-aligned ones go to the
/// device together (direct, through the batch ring), the others through the
/// page cache; every byte lands where it should, pieces in order, and each
/// write is counted once.
#[test]
fn a_write_batch_on_a_block_device_lands_and_counts_each_write() {
    const K: usize = 1024;
    let img = Image::new("batch", 16 << 20);
    let lo = Loop::attach(&img.0, false);
    let dev = FileDevice::open(Path::new(&lo.0), false).unwrap();
    let fill = |seed: u8, len: usize| -> Vec<u8> {
        (0..len)
            .map(|i| seed.wrapping_add((i / 512) as u8))
            .collect()
    };
    // 40 writes of 64 KiB (direct) made of 16 pieces each, and 10 small ones
    // (a block, and a block in two pieces) between them.
    let big: Vec<Vec<Vec<u8>>> = (0..40)
        .map(|w| (0..16).map(|p| fill((w * 16 + p) as u8, 4 * K)).collect())
        .collect();
    let small: Vec<Vec<u8>> = (0..10).map(|w| fill(200 + w as u8, 4 * K)).collect();
    let big_refs: Vec<Vec<&[u8]>> = big
        .iter()
        .map(|w| w.iter().map(|p| &p[..]).collect())
        .collect();
    let small_refs: Vec<Vec<&[u8]>> = small
        .iter()
        .map(|s| vec![&s[..2 * K], &s[2 * K..]])
        .collect();
    let mut writes: Vec<(u64, &[&[u8]])> = Vec::new();
    for (w, r) in big_refs.iter().enumerate() {
        writes.push(((w * 128 * K) as u64, &r[..]));
    }
    for (w, r) in small_refs.iter().enumerate() {
        writes.push(((8 << 20) + (w * 8 * K) as u64, &r[..]));
    }
    dev.write_batch(&writes, IoCategory::Data).unwrap();
    let s = dev.stats().snapshot();
    let d = s.category(IoCategory::Data);
    assert_eq!(
        (d.writes, d.write_bytes),
        (50, (40 * 64 * K + 10 * 4 * K) as u64)
    );
    // Read back through the device (buffered and direct reads alike).
    for (w, pieces) in big.iter().enumerate() {
        let mut back = vec![0u8; 64 * K];
        dev.read_at((w * 128 * K) as u64, &mut back, IoCategory::Data)
            .unwrap();
        assert_eq!(back, pieces.concat(), "large write {w}");
    }
    for (w, want) in small.iter().enumerate() {
        let mut back = vec![0u8; 4 * K];
        dev.read_at((8 << 20) + (w * 8 * K) as u64, &mut back, IoCategory::Data)
            .unwrap();
        assert_eq!(&back, want, "small write {w}");
    }
    // And on the image once flushed.
    dev.flush().unwrap();
    drop(dev);
    drop(lo);
    let on_disk = std::fs::read(&img.0).unwrap();
    assert_eq!(
        &on_disk[39 * 128 * K..39 * 128 * K + 64 * K],
        &big[39].concat()[..]
    );
    assert_eq!(&on_disk[8 << 20..(8 << 20) + 4 * K], &small[0][..]);
    // Out of range: refused before anything is written.
    let img2 = Image::new("batch2", 1 << 20);
    let dev = FileDevice::open(&img2.0, false).unwrap();
    let piece = [1u8; 4096];
    let r = dev.write_batch(&[(1 << 20, &[&piece[..]][..])], IoCategory::Data);
    assert!(matches!(r, Err(DeviceError::OutOfRange { .. })), "{r:?}");
}
