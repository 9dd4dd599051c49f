//! The runtime glue hyper needs: where hyper-util's clients run their
//! connections' tasks, and a server connection's timer, kept for reuse
//! rather than made for each request.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use crate::clock::Stopwatch;

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

/// One tokio timer kept for reuse, as hyper's [`hyper::rt::Timer`]: the
/// server gives one to each accepted connection for its header read
/// timeout, which hyper starts for every request head (and drops once the
/// head is read). A head's deadline is later than the one before, and
/// moving a tokio timer later, while it has not fired, is a
/// compare-and-swap (the wheel reschedules it when the old deadline comes),
/// where a timer of its own would be put in the wheel and taken out again
/// for every request (about 180 instructions more per fenced PUT on a
/// kept-alive connection, docs/performance.md). A kept timer that fired
/// (a request that took longer than the timeout) is put in the wheel again,
/// and once woke its task for nothing. A deadline earlier than the kept
/// timer's reschedules it; a slot found empty (its timer in use) makes a
/// new one. Cloning shares the slot. A slot serves one runtime: its timer
/// belongs to the runtime that made it.
#[derive(Clone, Debug, Default)]
pub struct TimerSlot(Arc<Mutex<Option<Pin<Box<Sleep>>>>>);

impl TimerSlot {
    /// A timer that fires at `deadline`: the kept one, moved, or a new one.
    /// Once dropped it goes back to the slot.
    pub fn sleep_until(&self, deadline: Instant) -> Reused {
        let kept = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        Reused {
            sleep: Some(moved_or_new(kept, deadline)),
            home: self.clone(),
        }
    }
}

/// The `kept` timer moved to `deadline` (see [`TimerSlot`] for what that
/// costs), or a new one if none is kept.
pub fn moved_or_new(kept: Option<Pin<Box<Sleep>>>, deadline: Instant) -> Pin<Box<Sleep>> {
    match kept {
        Some(mut sleep) => {
            sleep.as_mut().reset(deadline);
            sleep
        }
        None => Box::pin(tokio::time::sleep_until(deadline)),
    }
}

/// A timer taken from a [`TimerSlot`], which it goes back to when dropped
/// (if the slot is empty then).
#[derive(Debug)]
pub struct Reused {
    /// `None` only once dropped.
    sleep: Option<Pin<Box<Sleep>>>,
    home: TimerSlot,
}

impl Future for Reused {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.sleep.as_mut() {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}

impl hyper::rt::Sleep for Reused {}

impl Drop for Reused {
    fn drop(&mut self) {
        let Some(sleep) = self.sleep.take() else {
            return;
        };
        let mut slot = self.home.0.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(sleep);
        }
    }
}

impl hyper::rt::Timer for TimerSlot {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        hyper::rt::Timer::sleep_until(self, self.now() + duration)
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(TimerSlot::sleep_until(self, deadline.into()))
    }

    /// Now on tokio's clock, as hyper-util's `TokioTimer` reads it (hyper's
    /// own default reads the system's, which a paused tokio clock leaves
    /// behind).
    fn now(&self) -> std::time::Instant {
        Stopwatch::start().started().into_std()
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, deadline: std::time::Instant) {
        match sleep.as_mut().downcast_mut_pin::<Reused>() {
            Some(reused) => {
                if let Some(s) = reused.get_mut().sleep.as_mut() {
                    s.as_mut().reset(deadline.into());
                }
            }
            None => *sleep = hyper::rt::Timer::sleep_until(self, deadline),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> Instant {
        Stopwatch::start().started()
    }

    /// The kept timer, moved later, fires at its new deadline, not at the
    /// one it was first set to; moved earlier, at the earlier one.
    #[tokio::test(start_paused = true)]
    async fn a_kept_timer_fires_at_its_new_deadline() {
        let slot = TimerSlot::default();
        let start = now();
        let mut first = slot.sleep_until(start + Duration::from_secs(10));
        // Polled once, so that it is in tokio's timer wheel when moved.
        std::future::poll_fn(|cx| {
            assert!(Pin::new(&mut first).poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        drop(first);
        assert!(slot.0.lock().unwrap().is_some(), "the timer went back");

        let later = slot.sleep_until(start + Duration::from_secs(30));
        assert!(slot.0.lock().unwrap().is_none(), "the kept timer was taken");
        later.await;
        assert_eq!(now() - start, Duration::from_secs(30));

        let start = now();
        drop(slot.sleep_until(start + Duration::from_secs(60)));
        let earlier = slot.sleep_until(start + Duration::from_secs(5));
        earlier.await;
        assert_eq!(now() - start, Duration::from_secs(5));
    }
}
