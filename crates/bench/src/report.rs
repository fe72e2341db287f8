//! report.md (tables, plots, notes), machine and version information, and
//! `bench compare`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

use super::plot::PlotOut;
use super::results::{Results, Run};
use super::sys;

pub fn load(p: &Path) -> Result<Results> {
    let f = if p.is_dir() {
        p.join("results.json")
    } else {
        p.to_path_buf()
    };
    let s = std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
    serde_json::from_str(&s).with_context(|| format!("parsing {}", f.display()))
}

pub fn machine_info() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    let rd = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    m.insert("hostname".into(), rd("/proc/sys/kernel/hostname"));
    m.insert("kernel".into(), rd("/proc/sys/kernel/osrelease"));
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if let Some(l) = cpu.lines().find(|l| l.starts_with("model name")) {
        m.insert(
            "cpu".into(),
            l.split(':').nth(1).unwrap_or("").trim().to_string(),
        );
    }
    m.insert(
        "cpus".into(),
        std::thread::available_parallelism()
            .map(|n| n.get().to_string())
            .unwrap_or_default(),
    );
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    if let Some(l) = mem.lines().find(|l| l.starts_with("MemTotal")) {
        m.insert(
            "memory".into(),
            l.split(':').nth(1).unwrap_or("").trim().to_string(),
        );
    }
    m
}

/// Versions of commitfs and of every tool involved (Debian package versions).
pub fn versions() -> BTreeMap<String, String> {
    let mut v = BTreeMap::new();
    v.insert("commitfs".into(), env!("CARGO_PKG_VERSION").to_string());
    for pkg in [
        "e2fsprogs",
        "xfsprogs",
        "fuse2fs",
        "fuse3",
        "nbdkit",
        "libnbd-bin",
        "fsmark",
        "dbench",
        "postmark",
    ] {
        let ver = sys::run("dpkg-query", &["-W", "-f", "${Version}", pkg])
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        v.insert(
            pkg.into(),
            if ver.is_empty() {
                "not installed".into()
            } else {
                ver
            },
        );
    }
    v
}

/// The source tree's commit and whether it had local changes.
pub fn git_info() -> (String, bool) {
    let dir = env!("CARGO_MANIFEST_DIR");
    let commit = sys::run("git", &["-C", dir, "rev-parse", "HEAD"])
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let dirty = sys::run("git", &["-C", dir, "status", "--porcelain"])
        .map(|s| !s.trim().is_empty())
        .unwrap_or(false);
    (commit, dirty)
}

fn label(r: &Results, id: &str) -> String {
    r.systems
        .iter()
        .find(|s| s.id == id)
        .map(|s| s.label.clone())
        .unwrap_or_else(|| id.to_string())
}

fn f0(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn opt(v: Option<f64>) -> String {
    v.map(f0).unwrap_or_else(|| "-".into())
}

fn kib(b: u64) -> f64 {
    b as f64 / 1024.0
}

/// Mount-pass runs that succeeded, by (system, workload, variant).
fn find<'a>(r: &'a Results, sys: &str, w: &str, v: &str) -> Option<&'a Run> {
    r.runs.iter().find(|x| {
        x.pass == "mount" && x.system == sys && x.workload == w && x.variant == v && x.ok()
    })
}

/// The variant of a workload with the largest x (e.g. most threads).
fn max_variant(r: &Results, w: &str) -> Option<String> {
    r.runs
        .iter()
        .filter(|x| x.workload == w && x.ok())
        .max_by(|a, b| a.x.partial_cmp(&b.x).unwrap_or(std::cmp::Ordering::Equal))
        .map(|x| x.variant.clone())
}

/// The point of a workload used for cost: the most sync pressure (fsync
/// after every file for fc-micro, the most threads elsewhere).
pub fn cost_variant(r: &Results, w: &str) -> Option<String> {
    if w == "fc-micro" {
        min_variant(r, w)
    } else {
        max_variant(r, w)
    }
}

fn min_variant(r: &Results, w: &str) -> Option<String> {
    r.runs
        .iter()
        .filter(|x| x.workload == w && x.ok())
        .min_by(|a, b| a.x.partial_cmp(&b.x).unwrap_or(std::cmp::Ordering::Equal))
        .map(|x| x.variant.clone())
}

fn ran_systems(r: &Results) -> Vec<String> {
    let mut v: Vec<String> = r
        .systems
        .iter()
        .filter(|s| s.status == "ok" || r.runs.iter().any(|x| x.system == s.id))
        .map(|s| s.id.clone())
        .collect();
    for x in &r.runs {
        if !v.contains(&x.system) {
            v.push(x.system.clone());
        }
    }
    v
}

/// The headline table (also pasted into the README).
pub fn headline(r: &Results) -> String {
    let mut s = String::new();
    let fc1 = min_variant(r, "fc-micro").unwrap_or_else(|| "n=1".into());
    let vm = max_variant(r, "varmail-shared").unwrap_or_default();
    let fsm = max_variant(r, "fsmark").unwrap_or_default();
    let db = max_variant(r, "dbench").unwrap_or_default();
    let _ = writeln!(
        s,
        "| system | fc-micro {fc1}: fsyncs/s | fsync p50 / p99 µs | device KiB / writes / flushes per fsync | varmail-shared {vm} ops/s | fs_mark {fsm} files/s | dbench {db} MB/s | nfs-sync tx/s |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for id in ran_systems(r) {
        let fc = find(r, &id, "fc-micro", &fc1);
        let cell_fc = fc
            .map(|x| f0(x.result.fsyncs as f64 / x.result.secs.max(1e-9)))
            .unwrap_or_else(|| "-".into());
        let lat = fc
            .and_then(|x| x.result.fsync_lat.as_ref())
            .map(|l| format!("{} / {}", f0(l.p50_us), f0(l.p99_us)))
            .unwrap_or_else(|| "-".into());
        let dev = fc
            .map(|x| {
                format!(
                    "{} / {} / {}",
                    f0(x.per_fsync(x.device.write_bytes) / 1024.0),
                    f0(x.per_fsync(x.device.writes)),
                    f0(x.per_fsync(x.device.flushes))
                )
            })
            .unwrap_or_else(|| "-".into());
        let t = |w: &str, v: &str| {
            find(r, &id, w, v)
                .map(|x| f0(x.result.throughput))
                .unwrap_or_else(|| "-".into())
        };
        let nfs = max_variant(r, "nfs-sync").unwrap_or_default();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            label(r, &id),
            cell_fc,
            lat,
            dev,
            t("varmail-shared", &vm),
            t("fsmark", &fsm),
            t("dbench", &db),
            t("nfs-sync", &nfs)
        );
    }
    s
}

pub fn markdown(r: &Results, plots: &[PlotOut]) -> String {
    let mut s = String::new();
    let w = &mut s;
    let _ = writeln!(w, "# commitfs bench report\n");
    let dev = r.device.as_ref();
    let _ = writeln!(
        w,
        "{} run, {:.0} s, started at unix time {}; `{}`\n",
        if r.quick { "Quick" } else { "Full" },
        r.duration_secs,
        r.started_unix,
        r.command
    );
    let _ = writeln!(
        w,
        "- Machine: {} ({} CPUs, {}), kernel {}",
        r.machine.get("cpu").cloned().unwrap_or_default(),
        r.machine.get("cpus").cloned().unwrap_or_default(),
        r.machine.get("memory").cloned().unwrap_or_default(),
        r.machine.get("kernel").cloned().unwrap_or_default()
    );
    let _ = writeln!(
        w,
        "- commitfs {} at commit `{}`{}",
        r.versions.get("commitfs").cloned().unwrap_or_default(),
        r.git_commit,
        if r.git_dirty {
            " (with local changes)"
        } else {
            ""
        }
    );
    let _ = writeln!(
        w,
        "- Tools: {}",
        r.versions
            .iter()
            .filter(|(k, _)| k.as_str() != "commitfs")
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(d) = dev {
        let _ = writeln!(
            w,
            "- Device: {} ({} MiB), counters from {}",
            d.kind,
            d.size_bytes >> 20,
            d.counters_from
        );
        if let Some(p) = &d.profile {
            let _ = writeln!(
                w,
                "- Device model `{}` ({}): write {} µs, read {} µs, flush {} µs + dirty bytes at {} MB/s, FUA +{} µs, {} IOPS cap, {} MB/s cap (0 = none)",
                p.name, p.what, p.lat_write_us, p.lat_read_us, p.lat_flush_us, p.destage_mbps, p.lat_fua_us, p.iops, p.bw_mbps
            );
        }
    }

    let _ = writeln!(w, "\n## Systems\n");
    let _ = writeln!(
        w,
        "| system | status | mkfs | mount | after the run | notes |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|");
    for x in &r.systems {
        let mut notes = x.notes.clone();
        if !x.message.is_empty() {
            notes.insert(0, x.message.clone());
        }
        let _ = writeln!(
            w,
            "| {} | {} | `{}` | `{}` | {} | {} |",
            x.label,
            x.status,
            x.mkfs,
            x.mount,
            if x.fsck.is_empty() { "-" } else { &x.fsck },
            notes.join("; ").replace('|', "/")
        );
    }

    let _ = writeln!(w, "\n## Workloads\n");
    for x in &r.workloads {
        let _ = writeln!(w, "- **{}**: {} ({})", x.id, x.description, x.how);
    }

    let _ = writeln!(w, "\n## Headline\n");
    let _ = writeln!(w, "{}", headline(r));

    for p in plots {
        if p.ok {
            let _ = writeln!(w, "![{}]({})\n", p.title, p.file);
        } else {
            let _ = writeln!(w, "_Plot {} not drawn: {}_\n", p.file, p.message);
        }
    }

    let _ = writeln!(w, "## Results by workload\n");
    let _ = writeln!(
        w,
        "Per point: throughput; fsync latency (µs) where the workload issues fsyncs itself; device writes, KiB written and flushes per fsync (per op when it has none); journal KiB by disk region (emulated device); CPU seconds of the file system's own process or thread (commitfs/fuse2fs daemon, ext4's jbd2 thread) and of the application; p95 device IOPS and MB/s.\n"
    );
    let mut workloads: Vec<String> = Vec::new();
    for x in &r.runs {
        if !workloads.contains(&x.workload) {
            workloads.push(x.workload.clone());
        }
    }
    for wl in &workloads {
        let _ = writeln!(w, "### {wl}\n");
        let _ = writeln!(
            w,
            "| system | pass | point | throughput | fsync p50 / p95 / p99 µs | dev writes / KiB / flushes per fsync | journal KiB (fc KiB) | fs CPU s | app CPU s | p95 IOPS / MB/s |"
        );
        let _ = writeln!(w, "|---|---|---|---|---|---|---|---|---|---|");
        for x in r.runs.iter().filter(|x| &x.workload == wl) {
            if let Some(e) = &x.error {
                let _ = writeln!(
                    w,
                    "| {} | {} | {} | failed: {} | | | | | | |",
                    label(r, &x.system),
                    x.pass,
                    x.variant,
                    e.replace('|', "/").replace('\n', " ")
                );
                continue;
            }
            let lat = match (&x.result.fsync_lat, x.result.tool_fsync_mean_us) {
                (Some(l), _) => format!("{} / {} / {}", f0(l.p50_us), f0(l.p95_us), f0(l.p99_us)),
                (None, Some(m)) => {
                    format!("mean {} (max {})", f0(m), opt(x.result.tool_fsync_max_us))
                }
                _ => "-".into(),
            };
            let j = x
                .journal
                .map(|j| {
                    format!(
                        "{} ({})",
                        f0(kib(j.journal_bytes + j.fc_bytes)),
                        f0(kib(j.fc_bytes))
                    )
                })
                .or_else(|| {
                    x.commitfs.as_ref().map(|c| {
                        format!(
                            "{} ({})",
                            f0(kib(c.journal_bytes + c.fc_bytes)),
                            f0(kib(c.fc_bytes))
                        )
                    })
                })
                .unwrap_or_else(|| "-".into());
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} {} | {} | {} / {} / {} | {} | {} | {} | {} / {} |",
                label(r, &x.system),
                x.pass,
                x.variant,
                f0(x.result.throughput),
                x.result.unit,
                lat,
                f0(x.per_fsync(x.device.writes)),
                f0(x.per_fsync(x.device.write_bytes) / 1024.0),
                f0(x.per_fsync(x.device.flushes)),
                j,
                opt(x.cpu.fs_secs),
                f0(x.cpu.app_secs),
                f0(x.peak.p95_iops),
                f0(x.peak.p95_mbps)
            );
        }
        let _ = writeln!(w);
    }

    // commitfs's own breakdown.
    let lib: Vec<&Run> = r
        .runs
        .iter()
        .filter(|x| x.ok() && x.commitfs.is_some())
        .collect();
    if !lib.is_empty() {
        let _ = writeln!(w, "## commitfs journal breakdown (its own counters)\n");
        let _ = writeln!(
            w,
            "Pass 'mount': `commitfs stats DIR --json` deltas read from the FUSE daemon during the measured run. Pass 'library': the same workloads through the library (`Fs::stats`) on the same device, no FUSE. Totals for the point; 'device KiB written' is the device's own count for comparison.\n"
        );
        let _ = writeln!(
            w,
            "| system (journal mode) | pass | workload | point | ops/s | commits (fast) | log blocks | journal KiB / writes | fast-commit KiB / writes | data KiB | metadata KiB | flushes | FUA | checkpoints | device KiB written |"
        );
        let _ = writeln!(
            w,
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for x in lib {
            let Some(c) = &x.commitfs else { continue };
            let _ = writeln!(
                w,
                "| {} ({}) | {} | {} | {} | {} | {} ({}) | {} | {} / {} | {} / {} | {} | {} | {} | {} | {} | {} |",
                label(r, &x.system),
                c.journal_mode,
                x.pass,
                x.workload,
                x.variant,
                f0(x.result.throughput),
                c.commits,
                c.fc_commits,
                c.log_blocks,
                f0(kib(c.journal_bytes)),
                c.journal_writes,
                f0(kib(c.fc_bytes)),
                c.fc_writes,
                f0(kib(c.data_bytes)),
                f0(kib(c.metadata_bytes)),
                c.flushes,
                c.fua_writes,
                c.checkpoints,
                f0(kib(x.device.write_bytes))
            );
        }
        let _ = writeln!(w);
    }
    fuse_floor(w, r);
    let _ = writeln!(w, "## Cost (FastCommit §6.4)\n");
    let _ = writeln!(w, "{}\n", r.price_model.describe());
    let _ = writeln!(
        w,
        "'Bill' is the monthly price of a volume provisioned for the run as measured (capacity and the free baseline included, so small runs all cost the same). 'Per 1,000 ops/s' prices only the provisioned performance a system needs for each 1,000 application ops/s (p95 device IOPS and MB/s divided by its throughput, at the per-IOPS and per-MB/s rates): the comparison at equal work, as in the paper's cost-per-performance scatter plots; 'vs ext4' divides it by kernel ext4 (JBD2)'s. Shown for each workload's point with the most sync pressure (fc-micro n=1, otherwise the most threads). Units of 'ops' differ by workload (dbench: MB/s), so compare within a workload.\n"
    );
    let _ = writeln!(
        w,
        "| workload | point | system | throughput | p95 IOPS | p95 MB/s | bill $/month | IOPS / MB/s per 1,000 ops/s | $/month per 1,000 ops/s | vs ext4 |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|---|---|---|---|");
    for wl in &workloads {
        let Some(v) = cost_variant(r, wl) else {
            continue;
        };
        let base = find(r, "ext4", wl, &v)
            .map(|x| x.cost.per_kops_usd)
            .unwrap_or(0.0);
        for x in r
            .runs
            .iter()
            .filter(|x| x.pass == "mount" && &x.workload == wl && x.variant == v && x.ok())
        {
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} {} | {} | {} | {:.2} | {} / {} | {:.2} | {} |",
                wl,
                v,
                label(r, &x.system),
                f0(x.result.throughput),
                x.result.unit,
                f0(x.peak.p95_iops),
                f0(x.peak.p95_mbps),
                x.cost.measured_usd,
                f0(x.cost.iops_per_kops),
                f0(x.cost.mbps_per_kops),
                x.cost.per_kops_usd,
                if base > 0.0 {
                    format!("{:.2}x", x.cost.per_kops_usd / base)
                } else {
                    "-".into()
                }
            );
        }
    }

    let _ = writeln!(w, "\n## Notes\n");
    for n in &r.notes {
        let _ = writeln!(w, "- {n}");
    }
    let _ = writeln!(
        w,
        "\nReproduce: `{}`; compare two runs: `commitfs bench compare OLD_DIR NEW_DIR`.",
        r.command
    );
    s
}

/// Workloads whose one client waits for each request in turn: time per
/// operation is then the sum of its requests' round trips.
const ONE_CLIENT: [&str; 3] = ["fc-micro", "postmark", "cp-a"];

/// `(requests, daemon µs)` summed over `commitfs stats`' FUSE request
/// counters, FORGET left out: it has no reply, so nobody waits for it (and
/// the cache drop before `cp -a` sends thousands of them in the window).
fn fuse_requests(stats: &serde_json::Value) -> Option<(f64, f64)> {
    let m = stats.get("fuse_requests")?.as_object()?;
    let (mut n, mut us) = (0.0, 0.0);
    for (_, v) in m.iter().filter(|(k, _)| k.as_str() != "forget") {
        n += v.get("count")?.as_f64()?;
        us += v.get("total_us")?.as_f64()?;
    }
    (n > 0.0).then_some((n, us))
}

/// Where a one-client workload's time goes through FUSE: requests per
/// operation, the daemon's time per request, and the floor that the measured
/// null round trip puts under any daemon (requests × round trip), beside the
/// kernel's time per operation in the same run.
fn fuse_floor(w: &mut String, r: &Results) {
    let rows: Vec<(&Run, f64, f64, f64)> = r
        .runs
        .iter()
        .filter(|x| x.ok() && x.pass == "mount" && ONE_CLIENT.contains(&x.workload.as_str()))
        .filter_map(|x| {
            let (n, us) = fuse_requests(x.commitfs_stats.as_ref()?)?;
            Some((x, n, us, x.null_rt_us?))
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(w, "## FUSE requests per operation (one-client workloads)\n");
    let _ = writeln!(
        w,
        "One client waits for each request in turn (FORGET, which has no reply, is not counted), so an operation costs at least its requests times a null request's round trip (`getxattr` of a missing xattr on the mount, answered from memory; the least of five batches, measured after each point). 'Floor' is that product: what a daemon doing no work at all would take per operation here. 'Best ratio' is the kernel's time per operation divided by the floor: the most any FUSE daemon could reach against that kernel file system in this run, with these requests.\n"
    );
    let _ = writeln!(
        w,
        "| system | workload | point | requests / op | daemon µs / request | null round trip µs | floor µs / op | measured µs / op | kernel µs / op | best ratio |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|---|---|---|---|");
    for (x, n, us, rt) in rows {
        let ops = x.result.ops.max(1) as f64;
        let per_op = n / ops;
        let floor = per_op * rt;
        let measured = x.result.secs * 1e6 / ops;
        let kernel = ["ext4-fc", "ext4"].iter().find_map(|k| {
            find(r, k, &x.workload, &x.variant)
                .filter(|k| k.ok() && k.result.ops > 0)
                .map(|k| k.result.secs * 1e6 / k.result.ops as f64)
        });
        let _ = writeln!(
            w,
            "| {} | {} | {} | {:.2} | {:.1} | {:.1} | {:.0} | {:.0} | {} | {} |",
            label(r, &x.system),
            x.workload,
            x.variant,
            per_op,
            us / n,
            rt,
            floor,
            measured,
            kernel.map_or("-".into(), |k| format!("{k:.0}")),
            kernel.map_or("-".into(), |k| format!("{:.2}×", k / floor)),
        );
    }
    let _ = writeln!(w);
}

fn pct(a: f64, b: f64) -> String {
    if a == 0.0 {
        return "-".into();
    }
    let d = (b - a) / a * 100.0;
    let s = format!("{d:+.1}%");
    if d.abs() >= 10.0 {
        format!("**{s}**")
    } else {
        s
    }
}

/// `bench compare A B`: what changed between two runs.
pub fn compare(a: &Results, b: &Results, pa: &Path, pb: &Path) -> String {
    let mut s = String::new();
    let w = &mut s;
    let _ = writeln!(w, "# commitfs bench compare\n");
    let _ = writeln!(w, "| | A | B |\n|---|---|---|");
    let _ = writeln!(w, "| results | {} | {} |", pa.display(), pb.display());
    let _ = writeln!(w, "| commit | {} | {} |", a.git_commit, b.git_commit);
    let dk = |r: &Results| {
        r.device
            .as_ref()
            .map(|d| d.kind.clone())
            .unwrap_or_default()
    };
    let _ = writeln!(w, "| device | {} | {} |", dk(a), dk(b));
    let _ = writeln!(
        w,
        "| mode | {} | {} |",
        if a.quick { "quick" } else { "full" },
        if b.quick { "quick" } else { "full" }
    );
    for k in ["kernel", "cpu"] {
        let _ = writeln!(
            w,
            "| {k} | {} | {} |",
            a.machine.get(k).cloned().unwrap_or_default(),
            b.machine.get(k).cloned().unwrap_or_default()
        );
    }
    for (k, va) in &a.versions {
        let vb = b.versions.get(k).cloned().unwrap_or_default();
        if *va != vb {
            let _ = writeln!(w, "| {k} | {va} | {vb} |");
        }
    }
    if dk(a) != dk(b) {
        let _ = writeln!(
            w,
            "\nThe runs used different devices: differences are expected."
        );
    }
    let _ = writeln!(
        w,
        "\nChanges of 10% or more are in bold. Device counts are per fsync (per op without fsyncs).\n"
    );
    let _ = writeln!(
        w,
        "| system | pass | workload | point | throughput A → B | Δ | fsync p95 µs A → B | Δ | dev KiB/fsync A → B | Δ | flushes/fsync A → B | Δ |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    let idx: BTreeMap<_, &Run> = b.runs.iter().map(|r| (r.key(), r)).collect();
    let mut only_a = 0;
    for ra in &a.runs {
        let Some(rb) = idx.get(&ra.key()) else {
            only_a += 1;
            continue;
        };
        if !ra.ok() || !rb.ok() {
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} | {} → {} | | | | | | | |",
                ra.system,
                ra.pass,
                ra.workload,
                ra.variant,
                if ra.ok() { "ok" } else { "failed" },
                if rb.ok() { "ok" } else { "failed" }
            );
            continue;
        }
        let p95 = |r: &Run| r.result.fsync_lat.as_ref().map(|l| l.p95_us);
        let (la, lb) = (p95(ra), p95(rb));
        let ka = ra.per_fsync(ra.device.write_bytes) / 1024.0;
        let kb = rb.per_fsync(rb.device.write_bytes) / 1024.0;
        let fa = ra.per_fsync(ra.device.flushes);
        let fb = rb.per_fsync(rb.device.flushes);
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} → {} | {} | {} → {} | {} | {} → {} | {} | {} → {} | {} |",
            ra.system,
            ra.pass,
            ra.workload,
            ra.variant,
            f0(ra.result.throughput),
            f0(rb.result.throughput),
            pct(ra.result.throughput, rb.result.throughput),
            opt(la),
            opt(lb),
            match (la, lb) {
                (Some(x), Some(y)) => pct(x, y),
                _ => "-".into(),
            },
            f0(ka),
            f0(kb),
            pct(ka, kb),
            f0(fa),
            f0(fb),
            pct(fa, fb)
        );
    }
    let keys_a: std::collections::BTreeSet<_> = a.runs.iter().map(|r| r.key()).collect();
    let only_b = b.runs.iter().filter(|r| !keys_a.contains(&r.key())).count();
    if only_a + only_b > 0 {
        let _ = writeln!(
            w,
            "\n{only_a} point(s) only in A, {only_b} only in B (not compared)."
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::Run;
    use crate::workloads::WorkResult;

    fn run(sys: &str, thr: f64) -> Run {
        Run {
            system: sys.into(),
            pass: "mount".into(),
            workload: "fc-micro".into(),
            variant: "n=1".into(),
            x: 1.0,
            result: WorkResult {
                ops: 100,
                secs: 1.0,
                throughput: thr,
                unit: "files/s".into(),
                fsyncs: 100,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn compare_flags_big_changes() {
        let a = Results {
            runs: vec![run("ext4", 100.0), run("xfs", 50.0)],
            ..Default::default()
        };
        let b = Results {
            runs: vec![run("ext4", 150.0), run("commitfs", 1.0)],
            ..Default::default()
        };
        let s = compare(&a, &b, Path::new("A"), Path::new("B"));
        assert!(s.contains("**+50.0%**"), "{s}");
        assert!(s.contains("1 point(s) only in A, 1 only in B"), "{s}");
    }

    #[test]
    fn report_has_every_section() {
        let r = Results {
            runs: vec![run("ext4", 100.0)],
            ..Default::default()
        };
        let md = markdown(&r, &[]);
        for h in [
            "## Systems",
            "## Headline",
            "## Results by workload",
            "## Cost",
            "## Notes",
        ] {
            assert!(md.contains(h), "{h}");
        }
        let h = headline(&r);
        assert!(h.contains("| ext4 | 100 |"), "{h}");
    }

    #[test]
    fn fuse_floor_counts_requests_per_operation() {
        let mut c = run("commitfs-fc", 100.0);
        c.workload = "postmark".into();
        c.variant = "-".into();
        c.null_rt_us = Some(10.0);
        c.commitfs_stats = Some(serde_json::json!({
            "fuse_requests": {
                "getattr": {"count": 300, "total_us": 1500.0},
                "forget": {"count": 900, "total_us": 90.0},
                "write": {"count": 200, "total_us": 2500.0}
            }
        }));
        let mut k = run("ext4-fc", 1000.0);
        k.workload = "postmark".into();
        k.variant = "-".into();
        k.result.secs = 0.004;
        let r = Results {
            runs: vec![k, c],
            ..Default::default()
        };
        let md = markdown(&r, &[]);
        // 500 requests (FORGET, which has no reply, left out) for 100 ops,
        // 8 µs each in the daemon; floor 5 × 10 µs;
        // measured 1 s / 100 ops; the kernel 40 µs per op: at best 0.80×.
        assert!(
            md.contains("| postmark | - | 5.00 | 8.0 | 10.0 | 50 | 10000 | 40 | 0.80× |"),
            "{md}"
        );
        // No FUSE counters: no section.
        let plain = Results {
            runs: vec![run("ext4", 100.0)],
            ..Default::default()
        };
        assert!(!markdown(&plain, &[]).contains("## FUSE requests"));
    }
}
