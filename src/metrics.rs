//! Prometheus metrics, served at `/_fence/metrics` in the Prometheus text
//! format (0.0.4).
//!
//! Label sets are bounded: outcomes and reasons come from fixed lists, never
//! from lease names, holders or paths. Counters on the write hot path are
//! resolved once, so counting a forwarded write is one atomic add. Values the
//! lease store already keeps (leases held, writes in flight, barrier waits)
//! are read at scrape time by a collector instead of being counted twice.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::Registry;

use crate::clock::Clock;
use crate::lease::{LeaseStore, Primacy};

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
    stores: Stores,
}

/// Reads the lease stores' own counts at scrape time: one store, or (on a
/// cluster member with several shards) the stores of the shards it leads
/// now, plus what the stores of shards it led before had counted.
#[derive(Debug)]
struct StoreCollector {
    stores: Stores,
}

#[derive(Clone, Debug)]
enum Stores {
    One(LeaseStore),
    Shards(Arc<Mutex<ShardStores>>),
}

#[derive(Debug, Default)]
struct ShardStores {
    /// The stores of the shards led now, each with its term of primacy.
    led: Vec<(LeaseStore, Arc<Primacy>)>,
    /// Barrier waits, their milliseconds and timeouts of the stores of
    /// terms that ended: counters do not go back when a shard moves.
    ended: [u64; 3],
}

impl ShardStores {
    /// Lets go of the stores of terms that ended, keeping their counters.
    fn let_go_of_ended(&mut self) {
        let ended = &mut self.ended;
        self.led.retain(|(leases, primacy)| {
            let live = !primacy.is_revoked();
            if !live {
                for (sum, n) in ended.iter_mut().zip(barrier_counts(leases)) {
                    *sum += n;
                }
            }
            live
        });
    }
}

/// Cluster counters of a member with several shards.
#[derive(Debug, Default)]
pub struct ClusterStats {
    /// Requests sent on to the member leading their lease's shard.
    pub forwarded: AtomicU64,
    /// Shards this member handed over to another member (rebalancing).
    pub handovers_out: AtomicU64,
    /// Shards this member took over (won their election).
    pub takeovers: AtomicU64,
    /// Shards this member leads now.
    pub led: AtomicU64,
}

/// The counts a collector reports, summed over its stores.
#[derive(Default)]
struct Counts {
    held: usize,
    inflight: u64,
    barrier: [u64; 3],
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

fn barrier_counts(leases: &LeaseStore) -> [u64; 3] {
    let h = leases.handover_stats();
    [
        h.barrier_waits.load(Relaxed),
        h.barrier_wait_ms.load(Relaxed),
        h.barrier_timeouts.load(Relaxed),
    ]
}

impl Stores {
    fn counts(&self) -> (Counts, Option<Clock>) {
        match self {
            Stores::One(leases) => (
                Counts {
                    held: leases.held_count(),
                    inflight: leases.inflight_count(),
                    barrier: barrier_counts(leases),
                },
                Some(leases.clock().clone()),
            ),
            Stores::Shards(shards) => {
                let mut shards = shards.lock().unwrap_or_else(|p| p.into_inner());
                shards.let_go_of_ended();
                let ShardStores { led, ended } = &*shards;
                let mut counts = Counts {
                    barrier: *ended,
                    ..Counts::default()
                };
                for (leases, _) in led.iter() {
                    counts.held += leases.held_count();
                    counts.inflight += leases.inflight_count();
                    for (sum, n) in counts.barrier.iter_mut().zip(barrier_counts(leases)) {
                        *sum += n;
                    }
                }
                let clock = led.first().map(|(leases, _)| leases.clock().clone());
                (counts, clock)
            }
        }
    }
}

impl Collector for StoreCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (counts, clock) = self.stores.counts();
        let held = i64::try_from(counts.held).unwrap_or(i64::MAX);
        encode_const(
            &mut encoder,
            "fencegate_leases_held",
            "Leases with a live term.",
            ConstGauge::new(held),
        )?;
        let inflight = i64::try_from(counts.inflight).unwrap_or(i64::MAX);
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
            ConstCounter::new(counts.barrier[0]),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_barrier_wait_seconds",
            "Time writes spent waiting at the handover barrier.",
            ConstCounter::new(counts.barrier[1] as f64 / 1000.0),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_barrier_timeouts",
            "Writes refused because an earlier term's writes did not finish in time.",
            ConstCounter::new(counts.barrier[2]),
        )?;
        let suspended_ms = clock.map_or(0, |c| c.suspended_ms());
        encode_const(
            &mut encoder,
            "fencegate_clock_suspended_seconds",
            "Time the machine spent suspended since fencegate started, which the proxy's clock counts (CLOCK_BOOTTIME past CLOCK_MONOTONIC).",
            ConstCounter::new(suspended_ms as f64 / 1000.0),
        )
    }
}

/// Reads a sharded member's cluster counters at scrape time.
#[derive(Debug)]
struct ClusterCollector {
    stats: Arc<ClusterStats>,
}

impl Collector for ClusterCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.stats;
        encode_const(
            &mut encoder,
            "fencegate_requests_forwarded_to_member",
            "Requests for a lease of a shard another member leads, forwarded to that member.",
            ConstCounter::new(s.forwarded.load(Relaxed)),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_shard_handovers",
            "Shards this member handed over to another member to keep the shards balanced.",
            ConstCounter::new(s.handovers_out.load(Relaxed)),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_shard_takeovers",
            "Shards this member took over (won their election).",
            ConstCounter::new(s.takeovers.load(Relaxed)),
        )?;
        encode_const(
            &mut encoder,
            "fencegate_shards_led",
            "Shards this member leads now.",
            ConstGauge::new(i64::try_from(s.led.load(Relaxed)).unwrap_or(i64::MAX)),
        )
    }
}

impl Metrics {
    /// Metrics for a proxy whose lease store is `leases`.
    pub fn new(leases: &LeaseStore) -> Self {
        Self::with_stores(Stores::One(leases.clone()), None)
    }

    /// Metrics of a cluster member with several shards, shared by the apps
    /// of every shard it leads: the stores come and go with
    /// [`Metrics::add_shard`], and `stats` are the member's counters.
    pub fn for_shards(stats: Arc<ClusterStats>) -> Self {
        Self::with_stores(
            Stores::Shards(Arc::new(Mutex::new(ShardStores::default()))),
            Some(stats),
        )
    }

    /// Counts `leases` in while `primacy` (its shard's term) is not revoked.
    /// Stores of terms that ended are let go here and at each scrape.
    pub fn add_shard(&self, leases: &LeaseStore, primacy: &Arc<Primacy>) {
        if let Stores::Shards(shards) = &self.inner.stores {
            let mut shards = shards.lock().unwrap_or_else(|p| p.into_inner());
            shards.let_go_of_ended();
            shards.led.push((leases.clone(), primacy.clone()));
        }
    }

    fn with_stores(stores: Stores, cluster: Option<Arc<ClusterStats>>) -> Self {
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
            stores: stores.clone(),
        }));
        if let Some(stats) = cluster {
            registry.register_collector(Box::new(ClusterCollector { stats }));
        }
        Self {
            inner: Arc::new(Inner {
                registry,
                rejected,
                forwarded,
                lease_ops,
                upstream_seconds,
                stores,
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
