//! Names on the wire that several layers share: the fencing headers, the
//! request id, the path prefix fencegate keeps, and the response marker of an
//! unknown outcome. A leaf: it imports nothing from the crate, so the client
//! side, the backends and the fence can all use it without depending on each
//! other.

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

/// Set by a backend on a response it made up because the request's outcome
/// at the storage is unknown (connection lost, upstream timeout): the write
/// then keeps counting as in flight for the settle time.
#[derive(Clone, Copy, Debug)]
pub struct OutcomeUnknown;
