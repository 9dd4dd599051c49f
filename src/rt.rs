//! The runtime glue hyper-util's clients need: where their connections'
//! tasks run.

use std::future::Future;

/// Where hyper-util's clients (the pooled upstream, etcd, other members)
/// run their connections' tasks: on the runtime that built the client (the
/// first thread's, which serves until the process ends), not on whichever
/// serving thread happened to open a connection. A pooled connection may
/// serve any thread, and must outlive each of them.
#[derive(Clone, Debug)]
pub struct ClientExecutor(Option<tokio::runtime::Handle>);

impl ClientExecutor {
    /// The current runtime's (or, outside one, whichever runtime spawns).
    pub fn here() -> Self {
        Self(tokio::runtime::Handle::try_current().ok())
    }
}

impl<F> hyper::rt::Executor<F> for ClientExecutor
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, task: F) {
        match &self.0 {
            Some(runtime) => drop(runtime.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }
}
