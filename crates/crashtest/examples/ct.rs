fn main() {
    let a: Vec<String> = std::env::args().collect();
    let cfg = commitfs_crashtest::Config {
        workload: a[1].clone(),
        states: a[2].parse().unwrap(),
        seed: a[3].parse().unwrap(),
        torn: a.get(4).is_some_and(|x| x == "torn"),
        block_size: a.get(5).map_or(1024, |x| x.parse().unwrap()),
        save_failures: Some("/tmp/ctfail".into()),
        workers: 0,
        torn_superblock: a.get(6).is_some(),
    };
    let s = commitfs_crashtest::run(&cfg).unwrap();
    for f in s.failures.iter().take(5) {
        println!("FAIL k={} keep={} torn={} window={:?}: {}", f.spec.k, f.spec.keep_256, f.spec.torn, f.window, f.message);
    }
    println!("{s}");
}
