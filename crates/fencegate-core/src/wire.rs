//! Names on the wire that the proxy and its clients share: the fencing
//! headers, the request id, the cluster headers and the path prefix
//! fencegate keeps.

/// The header that carries the fencing token; passed on to the backend.
pub const FENCING_TOKEN: &str = "fencing-token";

/// The header that carries the lease id; never forwarded.
pub const FENCING_LEASE_ID: &str = "fencing-lease-id";

/// The request-id header: the client's, or a new one; echoed and forwarded.
pub const X_REQUEST_ID: &str = "x-request-id";

/// On a cluster member's `not-primary` answer: the primary's advertised URL.
pub const FENCEGATE_PRIMARY: &str = "fencegate-primary";

/// The path prefix fencegate keeps for itself.
pub const PREFIX: &str = "/_fence/";

/// On a request one cluster member forwards to another: the forwarding
/// member's name. A member never forwards such a request again (one hop).
/// Honoured only with [`FENCEGATE_MEMBER_KEY`].
pub const FENCEGATE_FORWARDED: &str = "fencegate-forwarded";

/// On a request one cluster member forwards to another: the cluster's
/// member key (kept in etcd), which proves the mark came from a member.
/// Never forwarded to the storage, never logged.
pub const FENCEGATE_MEMBER_KEY: &str = "fencegate-member-key";

/// On a forwarded listing (`GET /_fence/leases`): the one shard to list.
pub const FENCEGATE_SHARD: &str = "fencegate-shard";
