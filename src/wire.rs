//! Names on the wire that several layers share: the fencing headers, the
//! request id, the path prefix fencegate keeps, and the response marker of an
//! unknown outcome. A leaf: it imports nothing from the crate, so the client
//! side, the backends and the fence can all use it without depending on each
//! other.

pub use fencegate_core::wire::{
    FENCEGATE_FORWARDED, FENCEGATE_PRIMARY, FENCEGATE_SHARD, FENCING_LEASE_ID, FENCING_TOKEN,
    PREFIX, X_REQUEST_ID,
};

/// Set by a backend on a response it made up because the request's outcome
/// at the storage is unknown (connection lost, upstream timeout): the write
/// then keeps counting as in flight for the settle time.
#[derive(Clone, Copy, Debug)]
pub struct OutcomeUnknown;
