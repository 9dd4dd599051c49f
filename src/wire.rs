//! Names on the wire that several layers share: the fencing headers, the
//! request id and the path prefix fencegate keeps. A leaf: it imports
//! nothing from the crate, so the client side, the backends and the fence
//! can all use it without depending on each other.

pub use fencegate_core::wire::{
    FENCEGATE_FORWARDED, FENCEGATE_MEMBER_KEY, FENCEGATE_PRIMARY, FENCEGATE_SHARD,
    FENCING_LEASE_ID, FENCING_TOKEN, PREFIX, X_REQUEST_ID,
};
