//! `commitfs info`, `mkfs` and `demo` through the real binary; `info` is checked
//! field by field against `dumpe2fs -h`.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use commitfs::testutil::mkfs;

mod common;
use common::{check_fsck, FuseMount, KernelMount};

const BIN: &str = env!("CARGO_BIN_EXE_commitfs");

fn unique(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "commitfs-clitest-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Removes a file or an (empty or not) directory tree on drop.
struct Gone(PathBuf);
impl Drop for Gone {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn dumpe2fs(img: &Path) -> HashMap<String, String> {
    let out = Command::new("dumpe2fs")
        .arg("-h")
        .arg(img)
        .output()
        .unwrap();
    assert!(out.status.success(), "dumpe2fs failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

fn info_json(img: &Path) -> serde_json::Value {
    let out = Command::new(BIN)
        .args(["info", "--json"])
        .arg(img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "info failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("info --json prints JSON")
}

fn num(d: &HashMap<String, String>, k: &str) -> u64 {
    let v = d.get(k).unwrap_or_else(|| panic!("dumpe2fs has no {k:?}"));
    if let Some(h) = v.strip_prefix("0x") {
        u64::from_str_radix(h, 16).unwrap()
    } else {
        v.split_whitespace().next().unwrap().parse().unwrap()
    }
}

fn compare_with_dumpe2fs(img: &Path) -> serde_json::Value {
    let d = dumpe2fs(img);
    let j = info_json(img);
    let ju = |k: &str| j[k].as_u64().unwrap_or_else(|| panic!("json field {k}"));
    let mut want_features: Vec<&str> = d["Filesystem features"].split_whitespace().collect();
    let mut got_features: Vec<&str> = j["features"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        got_features, want_features,
        "feature order as dumpe2fs lists them"
    );
    want_features.sort();
    got_features.sort();
    assert_eq!(got_features, want_features);
    assert_eq!(ju("block_size"), num(&d, "Block size"));
    assert_eq!(ju("blocks"), num(&d, "Block count"));
    assert_eq!(ju("free_blocks"), num(&d, "Free blocks"));
    assert_eq!(ju("reserved_blocks"), num(&d, "Reserved block count"));
    assert_eq!(ju("inodes"), num(&d, "Inode count"));
    assert_eq!(ju("free_inodes"), num(&d, "Free inodes"));
    assert_eq!(ju("inode_size"), num(&d, "Inode size"));
    assert_eq!(ju("blocks_per_group"), num(&d, "Blocks per group"));
    assert_eq!(ju("inodes_per_group"), num(&d, "Inodes per group"));
    assert_eq!(ju("mount_count"), num(&d, "Mount count"));
    assert_eq!(j["uuid"].as_str().unwrap(), d["Filesystem UUID"]);
    let label = &d["Filesystem volume name"];
    let want_label = if label == "<none>" {
        ""
    } else {
        label.as_str()
    };
    assert_eq!(j["label"].as_str().unwrap(), want_label);
    assert_eq!(j["state"].as_str().unwrap(), d["Filesystem state"]);
    let groups = (ju("blocks") - num(&d, "First block")).div_ceil(ju("blocks_per_group"));
    assert_eq!(ju("groups"), groups);
    let jr = &j["journal"];
    assert_eq!(jr["inode"].as_u64().unwrap(), num(&d, "Journal inode"));
    assert_eq!(
        jr["s_maxlen"].as_u64().unwrap(),
        num(&d, "Total journal blocks")
    );
    assert_eq!(
        jr["size_blocks"].as_u64().unwrap(),
        num(&d, "Total journal blocks")
    );
    assert_eq!(
        jr["s_sequence"].as_u64().unwrap(),
        num(&d, "Journal sequence")
    );
    assert_eq!(jr["s_start"].as_u64().unwrap(), num(&d, "Journal start"));
    assert_eq!(jr["s_blocksize"].as_u64().unwrap(), ju("block_size"));
    assert_eq!(jr["s_first"].as_u64().unwrap(), 1);
    assert_eq!(jr["blocktype"].as_u64().unwrap(), 4);
    assert_eq!(jr["magic"].as_str().unwrap(), "0xc03b3998");
    let fc = d
        .get("Fast commit length")
        .map(|v| v.parse::<u64>().unwrap())
        .unwrap_or(0);
    assert_eq!(jr["fast_commit_blocks"].as_u64().unwrap(), fc);
    let want_jf = &d["Journal features"];
    let got_jf: Vec<&str> = jr["feature_names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    if want_jf == "(none)" {
        assert!(got_jf.is_empty(), "journal features {got_jf:?}");
    } else {
        // dumpe2fs has no name for FAST_COMMIT (prints FEATURE_I5).
        let want: Vec<String> = want_jf
            .split_whitespace()
            .map(|f| {
                if f == "FEATURE_I5" {
                    "journal_fast_commit".to_string()
                } else {
                    f.to_string()
                }
            })
            .collect();
        assert_eq!(got_jf, want);
    }
    // The journal superblock really sits where info says: check with debugfs.
    let bmap = Command::new("debugfs")
        .args(["-R", "bmap <8> 0"])
        .arg(img)
        .output()
        .unwrap();
    let first: u64 = String::from_utf8_lossy(&bmap.stdout)
        .trim()
        .parse()
        .unwrap();
    assert_eq!(jr["first_block"].as_u64().unwrap(), first);
    let recover =
        d["Filesystem features"].contains("needs_recovery") || num(&d, "Journal start") != 0;
    assert_eq!(j["needs_recovery"].as_bool().unwrap(), recover);
    j
}

#[test]
fn info_matches_dumpe2fs_on_fresh_images() {
    let a = mkfs("info-1k", 64, &[]);
    let j = compare_with_dumpe2fs(&a.path);
    assert_eq!(j["block_size"], 1024);
    assert_eq!(j["needs_recovery"], false);
    let b = mkfs("info-4k-fc", 1024, &["-O", "fast_commit", "-L", "my-label"]);
    let j = compare_with_dumpe2fs(&b.path);
    assert_eq!(j["label"], "my-label");
    assert_eq!(j["journal"]["fast_commit_blocks"], 128);
    assert_eq!(j["journal"]["s_maxlen"], 8320);
    // Human output says the same things.
    let out = Command::new(BIN).arg("info").arg(&b.path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Label:            my-label"), "{text}");
    assert!(text.contains("s_maxlen 8320"), "{text}");
    assert!(text.contains("Needs recovery:   no"), "{text}");
}

#[test]
fn info_after_use_and_with_recovery_needed() {
    let img = mkfs("info-used", 64, &[]);
    {
        let fs = commitfs::Fs::open_path(&img.path, Default::default()).unwrap();
        let f = fs.create(commitfs::ROOT_INO, b"f", 0o644, 0, 0).unwrap();
        fs.write(f.ino, 0, &[1u8; 100_000]).unwrap();
        fs.mkdir(commitfs::ROOT_INO, b"d", 0o755, 0, 0).unwrap();
        fs.unmount().unwrap();
    }
    let j = compare_with_dumpe2fs(&img.path);
    assert_eq!(j["state"], "clean");
    assert!(j["mount_count"].as_u64().unwrap() >= 1);

    // needs_recovery set in the superblock.
    let st = Command::new("debugfs")
        .args(["-w", "-R", "feature needs_recovery"])
        .arg(&img.path)
        .output()
        .unwrap();
    assert!(st.status.success());
    let j = compare_with_dumpe2fs(&img.path);
    assert_eq!(j["needs_recovery"], true);
    let out = Command::new(BIN)
        .arg("info")
        .arg(&img.path)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("Needs recovery:   yes"));
}

#[test]
fn info_sees_a_live_journal_log() {
    // A fresh image has no JBD2 checksums, so s_start can be patched directly.
    let img = mkfs("info-start", 64, &[]);
    let j = info_json(&img.path);
    assert_eq!(j["journal"]["features_incompat"], 0);
    let first = j["journal"]["first_block"].as_u64().unwrap();
    let f = fs::OpenOptions::new().write(true).open(&img.path).unwrap();
    f.write_all_at(&5u32.to_be_bytes(), first * 1024 + 0x1C)
        .unwrap();
    drop(f);
    let j = compare_with_dumpe2fs(&img.path);
    assert_eq!(j["journal"]["s_start"], 5);
    assert_eq!(j["needs_recovery"], true);
}

#[test]
fn info_rejects_what_is_not_ext4() {
    let p = unique("notext4");
    let _g = Gone(p.clone());
    fs::write(&p, vec![0u8; 1 << 20]).unwrap();
    let out = Command::new(BIN).arg("info").arg(&p).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a valid ext4 image"), "{err}");
    let out = Command::new(BIN)
        .arg("info")
        .arg(unique("missing"))
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn mkfs_makes_what_was_asked() {
    let p = unique("mkfs").with_extension("img");
    let _g = Gone(p.clone());
    let out = Command::new(BIN)
        .arg("mkfs")
        .arg(&p)
        .args([
            "--size",
            "64M",
            "--fast-commit",
            "--block-size",
            "1024",
            "-L",
            "lbl",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("65536 blocks of 1024 bytes"), "{text}");
    assert_eq!(fs::metadata(&p).unwrap().len(), 64 << 20);
    let d = dumpe2fs(&p);
    assert!(d["Filesystem features"].contains("fast_commit"));
    assert_eq!(num(&d, "Block size"), 1024);
    assert_eq!(num(&d, "Block count"), 65536);
    assert_eq!(d["Filesystem volume name"], "lbl");
    assert!(text.contains("lazy_itable_init=0"), "{text}");
    let v = commitfs::cmd::fsck::check(&p).unwrap();
    assert!(v.is_clean(), "{}", v.output);

    // Re-making with another size (--force: it holds a file system) resizes the
    // file; bad input fails.
    let out = Command::new(BIN)
        .arg("mkfs")
        .arg(&p)
        .args(["--size", "1G", "--force"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(fs::metadata(&p).unwrap().len(), 1 << 30);
    assert_eq!(num(&dumpe2fs(&p), "Block size"), 4096);
    for bad in [
        &["--size", "12Q"][..],
        &[][..],
        &["--size", "64M", "--block-size", "3000"][..],
    ] {
        let out = Command::new(BIN)
            .arg("mkfs")
            .arg(&p)
            .args(bad)
            .output()
            .unwrap();
        assert!(!out.status.success(), "mkfs {bad:?} succeeded");
    }
}

/// The numbers of a table row of `commitfs demo` (fsyncs/s, writes, KiB and
/// flushes per fsync) and its check column; `None` when there is no such row.
fn demo_row(text: &str, label: &str) -> Option<([f64; 4], String)> {
    let line = text.lines().find(|l| {
        l.trim_start()
            .strip_prefix(label)
            .is_some_and(|r| r.starts_with("  "))
            && l.trim_end().ends_with(['k', 'D'])
    })?;
    let rest = line.trim_start().strip_prefix(label)?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    assert_eq!(f.len(), 5, "row {line:?}");
    let n = |i: usize| -> f64 { f[i].parse().unwrap_or_else(|_| panic!("row {line:?}")) };
    Some(([n(0), n(1), n(2), n(3)], f[4].to_string()))
}

/// The first number after `prefix` in the line containing it.
fn demo_num(text: &str, prefix: &str) -> u64 {
    let line = text
        .lines()
        .find(|l| l.contains(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in:\n{text}"));
    let after = &line[line.find(prefix).unwrap() + prefix.len()..];
    after
        .split(|c: char| !c.is_ascii_digit())
        .find(|t| !t.is_empty())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no number after {prefix:?} in {line:?}"))
}

/// Nothing of the demo in `dir` is still mounted or attached to a loop device.
fn assert_nothing_left(dir: &Path) {
    let d = dir.to_string_lossy().into_owned();
    let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mi.contains(&d), "a mount under {d} is left:\n{mi}");
    if let Ok(out) = Command::new("losetup").arg("-a").output() {
        let l = String::from_utf8_lossy(&out.stdout);
        assert!(!l.contains(&d), "a loop device on {d} is left:\n{l}");
    }
}

const DEMO_COMMITFS_ROWS: [&str; 3] = [
    "commitfs JBD2 (nofast_commit)",
    "commitfs fast commit+fc_data_csum",
    "commitfs fast commit",
];
const DEMO_KERNEL_ROWS: [&str; 2] = ["kernel ext4 JBD2", "kernel ext4 fast_commit"];

/// The README's main command as it runs (default size): the fsync table with a
/// row per system whose counts make sense, the power cut and both recoveries.
#[test]
fn demo_shows_fsync_costs_and_survives_a_power_cut() {
    let dir = unique("demo");
    let _g = Gone(dir.clone());
    let out = Command::new(BIN)
        .args(["demo", "--dir"])
        .arg(&dir)
        .arg("--keep")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_nothing_left(&dir);
    assert!(
        text.contains("commitfs runs through a FUSE mount"),
        "{text}"
    );
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let mut rows = std::collections::HashMap::new();
    let kernel_rows: &[&str] = if root { &DEMO_KERNEL_ROWS } else { &[] };
    for label in DEMO_COMMITFS_ROWS.iter().chain(kernel_rows) {
        let (v, check) =
            demo_row(&text, label).unwrap_or_else(|| panic!("no row {label}:\n{text}"));
        assert_eq!(check, "ok", "{label}:\n{text}");
        assert!(
            v[0] > 0.0 && v[1] >= 1.0 && v[2] >= 4.0,
            "{label} {v:?}:\n{text}"
        );
        // Every fsync reached the media: at least one flush (or FUA write) each.
        assert!(v[3] >= 1.0, "{label} flushes/fsync {}:\n{text}", v[3]);
        rows.insert(*label, v);
    }
    if !root {
        assert!(text.contains("NOTE: kernel ext4 skipped"), "{text}");
    }
    // What the modes are for: fast commits log far less than full JBD2 commits,
    // fc_data_csum saves a flush per fsync.
    let (jbd2, fc, csum) = (
        rows["commitfs JBD2 (nofast_commit)"],
        rows["commitfs fast commit"],
        rows["commitfs fast commit+fc_data_csum"],
    );
    assert!(
        fc[2] < jbd2[2] * 0.7,
        "fast commit KiB/fsync {fc:?} vs JBD2 {jbd2:?}"
    );
    assert!(
        csum[3] < fc[3],
        "fc_data_csum flushes {csum:?} vs fast commit {fc:?}"
    );

    // The power cut: I/O was lost, recovery replayed the log, every fsynced
    // message is there, e2fsck is happy, and the kernel agrees.
    assert!(text.contains("the power failed during fsync #"), "{text}");
    assert!(demo_num(&text, "volatile cache held ") > 0, "{text}");
    let lost = demo_num(&text, "at that moment (");
    let torn = demo_num(&text, " lost, ");
    assert!(lost + torn > 0, "the power cut lost nothing:\n{text}");
    assert!(
        demo_num(&text, "commitfs recovery: replayed ") > 0,
        "{text}"
    );
    assert!(
        demo_num(&text, "blocks) and ") > 0,
        "no fast commits replayed:\n{text}"
    );
    assert!(demo_num(&text, "fsynced messages: all ") > 0, "{text}");
    assert!(
        text.contains("e2fsck -fn after commitfs's recovery: clean"),
        "{text}"
    );
    if root {
        assert!(text.contains("same tree as commitfs ("), "{text}");
        assert!(
            text.contains("e2fsck -fn after the kernel's recovery: clean"),
            "{text}"
        );
        assert!(dir.join("crash-kernel.img").exists());
    }
    assert!(text.contains("demo: PASS"), "{text}");
    assert!(dir.join("crash.img").exists(), "--keep keeps the images");
}

/// Without FUSE and without the kernel the demo says so, runs through the library,
/// still cuts the power and recovers, and leaves its temporary directory behind
/// nowhere.
#[test]
fn demo_degrades_without_fuse_and_kernel() {
    let out = Command::new(BIN)
        .args(["demo", "--messages", "40"])
        .env("COMMITFS_DEMO_NO_FUSE", "1")
        .env("COMMITFS_DEMO_NO_KERNEL", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "library demo failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("FUSE unavailable (COMMITFS_DEMO_NO_FUSE is set)"),
        "{text}"
    );
    assert!(text.contains("through the library API"), "{text}");
    assert!(
        text.contains("kernel ext4 skipped (COMMITFS_DEMO_NO_KERNEL is set)"),
        "{text}"
    );
    assert!(
        text.contains("Counted by commitfs's device layer"),
        "{text}"
    );
    for label in DEMO_COMMITFS_ROWS {
        let (v, check) =
            demo_row(&text, label).unwrap_or_else(|| panic!("no row {label}:\n{text}"));
        assert_eq!(check, "ok", "{label}:\n{text}");
        assert!(v[3] >= 1.0, "{label} flushes/fsync:\n{text}");
    }
    for label in DEMO_KERNEL_ROWS {
        assert!(demo_row(&text, label).is_none(), "{label} ran:\n{text}");
    }
    assert!(demo_num(&text, "fsynced messages: all ") > 0, "{text}");
    assert!(
        text.contains("e2fsck -fn after commitfs's recovery: clean"),
        "{text}"
    );
    assert!(!text.contains("same tree as commitfs"), "{text}");
    assert!(text.contains("demo: PASS"), "{text}");
    let tmp = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("commitfs demo in "))
        .expect("demo names its directory");
    assert!(!Path::new(tmp).exists(), "{tmp} left behind");
    assert_nothing_left(Path::new(tmp));
}

// ------------------------------------------------------- one user per image

/// `commitfs mount IMAGE` that must be refused: the refusal's message.
fn refused_mount(image: &Path, opts: &[&str]) -> String {
    match FuseMount::mount(Path::new(BIN), image, opts) {
        Ok(m) => panic!(
            "a second mount of {} at {} succeeded",
            image.display(),
            m.path().display()
        ),
        Err(e) => e,
    }
}

fn mkfs_cmd(image: &Path, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("mkfs")
        .arg(image)
        .args(args)
        .output()
        .unwrap()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The source (loop device) of the mount at `dir`.
fn mount_source(dir: &Path) -> String {
    let text = fs::read_to_string("/proc/self/mounts").unwrap();
    text.lines()
        .find_map(|l| {
            let mut it = l.split(' ');
            let src = it.next()?;
            (it.next()? == dir.to_str()?).then(|| src.to_string())
        })
        .unwrap_or_else(|| panic!("{} is not mounted", dir.display()))
}

fn uuid(img: &Path) -> String {
    dumpe2fs(img)["Filesystem UUID"].clone()
}

/// Whether the "held by process N" of `msg` names `pid` or a child of it: a root
/// daemon serves from a sandboxed child of the process its pid file names
/// (crates/cli/src/sandbox.rs), and that child holds the image.
fn names_holder(msg: &str, pid: u32) -> bool {
    let Some(rest) = msg.split("held by process ").nth(1) else {
        return false;
    };
    let named: u32 = match rest
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap_or("")
        .parse()
    {
        Ok(n) => n,
        Err(_) => return false,
    };
    if named == pid {
        return true;
    }
    // Field 4 of /proc/N/stat, after the parenthesised command name.
    fs::read_to_string(format!("/proc/{named}/stat"))
        .ok()
        .and_then(|st| st.rsplit_once(')').map(|(_, r)| r.to_string()))
        .and_then(|r| {
            r.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u32>().ok())
        })
        == Some(pid)
}

#[test]
fn a_second_commitfs_mount_is_refused_and_names_the_first() {
    let img = mkfs("two-mounts", 64, &[]);
    let mut first = FuseMount::mount(Path::new(BIN), &img.path, &[]).unwrap();
    fs::write(first.path().join("written-by-first"), b"first").unwrap();
    let pid = first.pid().unwrap();
    for opts in [&[][..], &["-o", "ro"][..]] {
        let msg = refused_mount(&img.path, opts);
        assert!(msg.contains("is in use"), "{msg}");
        assert!(names_holder(&msg, pid), "{msg} (daemon {pid})");
        assert!(
            msg.contains(&format!("mounted at {}", first.path().display())),
            "{msg}"
        );
    }
    // Still served by the first mount, and written home on unmount.
    assert_eq!(
        fs::read(first.path().join("written-by-first")).unwrap(),
        b"first"
    );
    first.unmount().unwrap();
    check_fsck(&img.path, "after two mount attempts").unwrap();
    // The lock left with the daemon: mounting works again and sees the file.
    let again = FuseMount::mount(Path::new(BIN), &img.path, &[]).unwrap();
    assert_eq!(
        fs::read(again.path().join("written-by-first")).unwrap(),
        b"first"
    );
}

#[test]
fn commitfs_beside_a_kernel_mount_is_refused() {
    let img = mkfs("beside-kernel", 64, &[]);
    let mut km = KernelMount::mount(&img.path, "noatime").unwrap();
    let lo = mount_source(km.path());
    assert!(lo.starts_with("/dev/loop"), "{lo}");
    fs::write(km.path().join("kernel-file"), b"kernel").unwrap();
    let dir = km.path().display().to_string();
    // The image file: the e2fsprogs-style check finds the mount through the loop device.
    for opts in [&[][..], &["-o", "ro"][..]] {
        let msg = refused_mount(&img.path, opts);
        assert!(msg.contains(&format!("mounted at {dir} (ext4")), "{msg}");
        assert!(msg.contains(&format!("through loop device {lo}")), "{msg}");
    }
    // The loop device itself: O_EXCL fails with EBUSY, the mount table names it.
    let msg = refused_mount(Path::new(&lo), &[]);
    assert!(msg.contains(&format!("mounted at {dir} (ext4)")), "{msg}");
    // mkfs neither, not even with --force; and the kernel's file system is intact.
    for force in [false, true] {
        let mut args = vec!["--size", "64M"];
        if force {
            args.push("--force");
        }
        let o = mkfs_cmd(&img.path, &args);
        assert!(!o.status.success(), "mkfs {args:?} on a mounted image");
        assert!(
            stderr(&o).contains(&format!("mounted at {dir}")),
            "{}",
            stderr(&o)
        );
    }
    assert_eq!(fs::read(km.path().join("kernel-file")).unwrap(), b"kernel");
    km.unmount().unwrap();
    check_fsck(&img.path, "kernel image after refused commitfs").unwrap();
}

#[test]
fn mkfs_on_a_mounted_image_is_refused_and_changes_nothing() {
    let img = mkfs("mkfs-mounted", 64, &[]);
    let before_uuid = uuid(&img.path);
    let mut m = FuseMount::mount(Path::new(BIN), &img.path, &[]).unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    fs::write(m.path().join("precious"), &data).unwrap();
    for args in [
        &["--size", "32M"][..],
        &["--size", "32M", "--force"][..],
        &["--size", "64M", "--force"][..],
    ] {
        let o = mkfs_cmd(&img.path, args);
        let err = stderr(&o);
        assert!(!o.status.success(), "mkfs {args:?} on a mounted image");
        assert!(err.contains("will not make a file system here"), "{err}");
        assert!(
            err.contains(&format!("mounted at {}", m.path().display())),
            "{err}"
        );
        assert_eq!(fs::metadata(&img.path).unwrap().len(), 64 << 20, "{args:?}");
    }
    assert_eq!(fs::read(m.path().join("precious")).unwrap(), data);
    m.unmount().unwrap();
    check_fsck(&img.path, "image mkfs was refused on").unwrap();
    assert_eq!(uuid(&img.path), before_uuid);
    let fs = commitfs::Fs::open_path(
        &img.path,
        commitfs::MountOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    let ino = fs.lookup(commitfs::ROOT_INO, b"precious").unwrap().ino;
    let mut back = vec![0u8; data.len()];
    assert_eq!(fs.read(ino, 0, &mut back).unwrap(), data.len());
    assert_eq!(back, data);
}

#[test]
fn mkfs_over_a_file_system_needs_force_and_never_shrinks_without_it() {
    let p = unique("mkfs-force").with_extension("img");
    let _g = Gone(p.clone());
    let o = mkfs_cmd(&p, &["--size", "64M", "-L", "old-one"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Used once, so it has a last-mount time.
    {
        let fs = commitfs::Fs::open_path(&p, Default::default()).unwrap();
        fs.unmount().unwrap();
    }
    let first = uuid(&p);
    for (args, shrink) in [
        (&["--size", "64M"][..], false),
        (&["--size", "32M"][..], true),
    ] {
        let o = mkfs_cmd(&p, args);
        let err = stderr(&o);
        assert!(!o.status.success(), "mkfs {args:?} over a file system");
        assert!(err.contains("already holds an ext4 file system"), "{err}");
        assert!(err.contains("label \"old-one\""), "{err}");
        assert!(err.contains("64.0 MiB"), "{err}");
        assert!(err.contains("last mounted"), "{err}");
        assert!(err.contains("--force"), "{err}");
        assert_eq!(
            err.contains("shrink the file from 64.0 MiB to 32.0 MiB"),
            shrink,
            "{err}"
        );
        assert_eq!(fs::metadata(&p).unwrap().len(), 64 << 20);
        assert_eq!(uuid(&p), first, "refused mkfs changed the file system");
    }
    // --force overwrites, shrinking too.
    let o = mkfs_cmd(&p, &["--size", "32M", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(fs::metadata(&p).unwrap().len(), 32 << 20);
    assert_ne!(uuid(&p), first);
    check_fsck(&p, "mkfs --force").unwrap();
    // Fractional sizes.
    let o = mkfs_cmd(&p, &["--size", "1.5G", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(fs::metadata(&p).unwrap().len(), 3 << 29);
    let d = dumpe2fs(&p);
    assert_eq!(num(&d, "Block count") * num(&d, "Block size"), 3 << 29);
    // Another kind of file system is recognised too (blkid).
    let swap = unique("mkfs-swap").with_extension("img");
    let _g2 = Gone(swap.clone());
    fs::File::create(&swap).unwrap().set_len(8 << 20).unwrap();
    let st = Command::new("mkswap").arg(&swap).output().unwrap();
    assert!(st.status.success());
    let o = mkfs_cmd(&swap, &["--size", "8M"]);
    assert!(!o.status.success(), "mkfs over swap space");
    assert!(stderr(&o).contains("a swap file system"), "{}", stderr(&o));
    // A new file needs no --force.
    let q = unique("mkfs-new").with_extension("img");
    let _g3 = Gone(q.clone());
    let o = mkfs_cmd(&q, &["--size", "1.5G"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(fs::metadata(&q).unwrap().len(), 3 << 29);
}

#[test]
fn info_on_a_mounted_image_warns_and_reports() {
    let img = mkfs("info-mounted", 64, &["-L", "busy"]);
    let mut m = FuseMount::mount(Path::new(BIN), &img.path, &[]).unwrap();
    let out = Command::new(BIN)
        .arg("info")
        .arg(&img.path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("warning"), "{err}");
    assert!(err.contains("is in use"), "{err}");
    assert!(
        err.contains(&format!("mounted at {}", m.path().display())),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Label:            busy"));
    m.unmount().unwrap();
    let out = Command::new(BIN)
        .arg("info")
        .arg(&img.path)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
}

#[test]
fn mount_says_what_is_wrong_with_the_image() {
    // Empty.
    let empty = unique("empty").with_extension("img");
    let _g = Gone(empty.clone());
    fs::write(&empty, b"").unwrap();
    let msg = refused_mount(&empty, &[]);
    assert!(msg.contains("empty (0 bytes)"), "{msg}");
    assert!(msg.contains("commitfs mkfs"), "{msg}");
    let out = Command::new(BIN).arg("info").arg(&empty).output().unwrap();
    assert!(stderr(&out).contains("empty (0 bytes)"), "{}", stderr(&out));
    // Immutable: suggest -o ro, which works.
    let img = mkfs("immutable", 64, &[]);
    // Dropped before `img` (which removes the file).
    struct NoImmutable<'a>(&'a Path);
    impl Drop for NoImmutable<'_> {
        fn drop(&mut self) {
            let _ = Command::new("chattr").arg("-i").arg(self.0).status();
        }
    }
    let _ni = NoImmutable(&img.path);
    assert!(Command::new("chattr")
        .arg("+i")
        .arg(&img.path)
        .status()
        .unwrap()
        .success());
    let msg = refused_mount(&img.path, &[]);
    assert!(msg.contains("immutable"), "{msg}");
    assert!(msg.contains("-o ro"), "{msg}");
    let mut ro = FuseMount::mount(Path::new(BIN), &img.path, &["-o", "ro"]).unwrap();
    assert!(ro.path().join("lost+found").is_dir());
    ro.unmount().unwrap();
}

#[test]
fn a_daemonized_mount_holds_the_image_while_it_serves() {
    // Without --foreground the image is opened after the fork: the serving
    // daemon (not the parent, which exits) must hold it.
    let img = mkfs("daemon-lock", 64, &[]);
    let dir = common::TempDir::new("daemon-mnt");
    let pidf = common::TempFile {
        path: unique("daemon-pid"),
    };
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            if common::is_mounted(self.0, "fuse") {
                let _ = Command::new("fusermount3").arg("-uz").arg(self.0).status();
            }
        }
    }
    let out = Command::new(BIN)
        .arg("mount")
        .arg(&img.path)
        .arg(&dir.path)
        .arg("--pid-file")
        .arg(&pidf.path)
        .output()
        .unwrap();
    let _u = Unmount(&dir.path);
    assert!(out.status.success(), "{}", stderr(&out));
    let pid: u32 = fs::read_to_string(&pidf.path)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    fs::write(dir.path.join("f"), b"daemon").unwrap();
    let msg = refused_mount(&img.path, &[]);
    assert!(names_holder(&msg, pid), "{msg} (daemon {pid})");
    assert!(
        msg.contains(&format!("mounted at {}", dir.path.display())),
        "{msg}"
    );
    let o = mkfs_cmd(&img.path, &["--size", "64M", "--force"]);
    assert!(!o.status.success(), "mkfs beside the daemon");
    // Unmounted: the daemon exits and the image is free again.
    assert!(Command::new("umount")
        .arg(&dir.path)
        .status()
        .unwrap()
        .success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    // Gone, or a zombie waiting for whoever inherited it.
    let alive = || {
        fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| !r.trim_start().starts_with('Z'))
        })
    };
    while alive() {
        assert!(
            std::time::Instant::now() < deadline,
            "daemon {pid} did not exit"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    check_fsck(&img.path, "after the daemon").unwrap();
    let again = FuseMount::mount(Path::new(BIN), &img.path, &[]).unwrap();
    assert_eq!(fs::read(again.path().join("f")).unwrap(), b"daemon");
}

/// `--version` names the commit the binary was built from (crates/cli/build.rs).
#[test]
fn version_names_the_commit() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(out.status.success());
    let v = String::from_utf8_lossy(&out.stdout);
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output();
    match head {
        Ok(h) if h.status.success() => {
            let h = String::from_utf8_lossy(&h.stdout).trim().to_string();
            assert!(
                v.contains(&format!("(commit {h}")),
                "--version {v:?} does not name HEAD {h}"
            );
        }
        // Built outside a git checkout: the build script says so.
        _ => assert!(v.contains("(commit unknown)"), "{v:?}"),
    }
}
