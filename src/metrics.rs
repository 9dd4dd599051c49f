//! Prometheus metrics, served at `/_fence/metrics` in the Prometheus text
//! format (0.0.4).
//!
//! Label sets are bounded: outcomes and reasons come from fixed lists, never
//! from lease names, holders or paths. Counters on the write hot path are
//! resolved once, so counting a forwarded write is one atomic add. Values the
//! lease store already keeps (leases held, writes in flight, barrier waits)
//! are read at scrape time by a collector instead of being counted twice.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::Registry;

use crate::lease::LeaseStore;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseOpLabels {
    op: &'static str,
    outcome: &'static str,
}

/// The proxy's metrics; cheap to clone, shared by every layer that counts.
#[derive(Clone, Debug)]
pub struct Metrics {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    rejected: Family<ReasonLabel, Counter>,
    forwarded: Counter,
    lease_ops: Family<LeaseOpLabels, Counter>,
    upstream_seconds: Histogram,
}

/// Reads the lease store's own counts at scrape time.
#[derive(Debug)]
struct StoreCollector {
    leases: LeaseStore,
}

fn encode_const<M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: M,
) -> Result<(), std::fmt::Error> {
    let e = encoder.encode_descriptor(name, help, None, M::TYPE)?;
    metric.encode(e)
}

impl Collector for StoreCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let h = self.leases.handover_stats();
        let held = i64::try_from(self.leases.held_count()).unwrap_or(i64::MAX);
        encode_const(
            &mut encoder,
            "fencegate_leases_held",
            "Leases with a live term.",
            ConstGauge::new(held),
        )?;
        let inflight = i64::try_from(self.leases.inflight_count()).unwrap_or(i64::MAX);
        encode_const(
            &mut encoder,
            "fencegate_writes_in_flight",
            "Admitted writes not yet finished at the backend.",
            ConstGauge::new(inflight),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_barrier_waits",
            "Writes that waited for an earlier term's writes to finish.",
            ConstCounter::new(h.barrier_waits.load(Relaxed)),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_barrier_wait_seconds",
            "Time writes spent waiting at the handover barrier.",
            ConstCounter::new(h.barrier_wait_ms.load(Relaxed) as f64 / 1000.0),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_barrier_timeouts",
            "Writes refused because an earlier term's writes did not finish in time.",
            ConstCounter::new(h.barrier_timeouts.load(Relaxed)),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_clock_suspended_seconds",
            "Time the machine spent suspended since fencegate started, which the proxy's clock counts (CLOCK_BOOTTIME past CLOCK_MONOTONIC).",
            ConstCounter::new(self.leases.clock().suspended_ms() as f64 / 1000.0),
        )
    }
}

impl Metrics {
    /// Metrics for a proxy whose lease store is `leases`.
    pub fn new(leases: &LeaseStore) -> Self {
        let mut registry = Registry::default();
        let forwarded = Counter::default();
        registry.register(
            "fencegate_writes_forwarded",
            "Fenced requests admitted and sent to the backend",
            forwarded.clone(),
        );
        let rejected = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "fencegate_writes_rejected",
            "Requests the fence refused, by problem reason",
            rejected.clone(),
        );
        let lease_ops = Family::<LeaseOpLabels, Counter>::default();
        registry.register(
            "fencegate_lease_operations",
            "Lease API operations by kind and outcome",
            lease_ops.clone(),
        );
        let upstream_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        registry.register(
            "fencegate_upstream_request_duration_seconds",
            "Time from sending a request upstream to its response head",
            upstream_seconds.clone(),
        );
        registry.register_collector(Box::new(StoreCollector {
            leases: leases.clone(),
        }));
        Self {
            inner: Arc::new(Inner {
                registry,
                rejected,
                forwarded,
                lease_ops,
                upstream_seconds,
            }),
        }
    }

    /// A fenced request went on to the backend.
    pub fn write_forwarded(&self) {
        self.inner.forwarded.inc();
    }

    /// A fenced request was refused with `reason`.
    pub fn write_rejected(&self, reason: &'static str) {
        self.inner
            .rejected
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A lease operation (`acquire`, `renew`, `release`) ended with `outcome`
    /// (`ok` or a problem reason).
    pub fn lease_op(&self, op: &'static str, outcome: &'static str) {
        self.inner
            .lease_ops
            .get_or_create(&LeaseOpLabels { op, outcome })
            .inc();
    }

    /// An upstream request took `seconds` to its response head.
    pub fn upstream_latency(&self, seconds: f64) {
        self.inner.upstream_seconds.observe(seconds);
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.inner.registry);
        out
    }
}
