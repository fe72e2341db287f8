//! Monthly cost of the block storage a workload needs (FastCommit §6.4): cloud
//! volumes with independently provisioned IOPS and throughput are sized to the
//! workload's p95 device IOPS and p95 bandwidth; the price is what that
//! provisioning costs per month.
//!
//! The price model is a documented assumption, not a quote: it follows the shape
//! of public list prices for such volumes (a capacity price, a baseline of IOPS
//! and throughput included, a price per provisioned IOPS and per MB/s above it).
//! Change the constants here to price another offering.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PriceModel {
    pub name: String,
    pub capacity_gib: f64,
    pub usd_per_gib_month: f64,
    pub included_iops: f64,
    pub usd_per_iops_month: f64,
    pub included_mbps: f64,
    pub usd_per_mbps_month: f64,
}

impl Default for PriceModel {
    fn default() -> Self {
        PriceModel {
            name: "provisioned-performance volume (gp3-like list-price shape)".into(),
            capacity_gib: 100.0,
            usd_per_gib_month: 0.08,
            included_iops: 3000.0,
            usd_per_iops_month: 0.005,
            included_mbps: 125.0,
            usd_per_mbps_month: 0.04,
        }
    }
}

/// A cost estimate in USD per month.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// The monthly bill of a volume provisioned for the run as measured (its
    /// p95 IOPS and MB/s; capacity and the included baseline count).
    pub measured_usd: f64,
    /// Provisioning cost per 1,000 application ops/s: the p95 IOPS and MB/s the
    /// system needs per application op, priced at the per-IOPS and per-MB/s
    /// rates (no capacity, no free baseline), so systems compare at equal work.
    pub per_kops_usd: f64,
    /// Device IOPS and MB/s (p95) per 1,000 application ops/s.
    pub iops_per_kops: f64,
    pub mbps_per_kops: f64,
}

impl PriceModel {
    pub fn monthly(&self, iops: f64, mbps: f64) -> f64 {
        self.capacity_gib * self.usd_per_gib_month
            + (iops - self.included_iops).max(0.0) * self.usd_per_iops_month
            + (mbps - self.included_mbps).max(0.0) * self.usd_per_mbps_month
    }

    /// `p95_*` measured while the system delivered `throughput` app ops/s.
    pub fn estimate(&self, p95_iops: f64, p95_mbps: f64, throughput: f64) -> Cost {
        let per_k = if throughput > 0.0 {
            1000.0 / throughput
        } else {
            0.0
        };
        let (i, m) = (p95_iops * per_k, p95_mbps * per_k);
        Cost {
            measured_usd: self.monthly(p95_iops, p95_mbps),
            per_kops_usd: i * self.usd_per_iops_month + m * self.usd_per_mbps_month,
            iops_per_kops: i,
            mbps_per_kops: m,
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{}: {} GiB at ${}/GiB-month; {} IOPS and {} MB/s included; ${}/IOPS-month and ${}/MB/s-month above that. \
             IOPS = device reads + writes per second (flushes are not billed as I/Os); both sized at the p95 of 1-second windows.",
            self.name,
            self.capacity_gib,
            self.usd_per_gib_month,
            self.included_iops,
            self.included_mbps,
            self.usd_per_iops_month,
            self.usd_per_mbps_month
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_is_free_and_excess_is_priced() {
        let m = PriceModel::default();
        let base = m.capacity_gib * m.usd_per_gib_month;
        assert_eq!(m.monthly(100.0, 10.0), base);
        let c = m.monthly(13_000.0, 225.0);
        assert!((c - (base + 10_000.0 * 0.005 + 100.0 * 0.04)).abs() < 1e-9);
        // Twice the I/O per op costs twice as much per 1,000 ops/s.
        let a = m.estimate(5000.0, 0.0, 1000.0);
        let b = m.estimate(10000.0, 0.0, 1000.0);
        assert!((a.iops_per_kops - 5000.0).abs() < 1e-9);
        assert!((a.per_kops_usd - 25.0).abs() < 1e-9);
        assert!((b.per_kops_usd - 2.0 * a.per_kops_usd).abs() < 1e-9);
    }
}
