use std::time::Instant;
fn main() {
    let base = commitfs_crashtest::base_image(1024).unwrap();
    let rec = commitfs_crashtest::record(commitfs_crashtest::find("mixed").unwrap(), &base, 1).unwrap();
    let scratch = commitfs_crashtest::ScratchFile::new("prof");
    let img = rec.log.full_image(rec.unmount_start);
    let (lo, n) = rec.window(rec.unmount_start);
    let a = Instant::now();
    for _ in 0..20 {
        commitfs_crashtest::check_image(&rec, img.clone(), lo, n, n, &scratch).unwrap();
    }
    println!("check_image {:.1}ms", a.elapsed().as_secs_f64() * 50.0);
    let a = Instant::now();
    for _ in 0..20 {
        let _ = commitfs_crashtest::check::fsck_image(&img, &scratch, "x");
    }
    println!("fsck_image {:.1}ms", a.elapsed().as_secs_f64() * 50.0);
    let a = Instant::now();
    for _ in 0..20 {
        let o = std::process::Command::new("e2fsck").arg("-fn").arg(&scratch.path).output().unwrap();
        assert!(!o.stdout.is_empty());
    }
    println!("e2fsck only {:.1}ms", a.elapsed().as_secs_f64() * 50.0);
    let a = Instant::now();
    for _ in 0..20 {
        scratch.write(&img).unwrap();
    }
    println!("write only {:.1}ms", a.elapsed().as_secs_f64() * 50.0);
}
