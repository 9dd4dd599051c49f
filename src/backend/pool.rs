//! The pooled mode's idle upstream connections
//! ([`ConnectionMode::Pooled`](super::ConnectionMode::Pooled)): connections
//! of fencegate's own HTTP/1.1 client ([`super::h1`]) that the connections
//! of one client share, with bounds on everything.
//!
//! - **One client's connections serve that client only**: a client is its
//!   address (an IPv6 address by its /64, as one host holds a whole /64)
//!   and, with authentication on, its caller. A storage that sends an
//!   answer nobody asked for (response queue poisoning) can hand it to no
//!   other client, and a connection on which anything unasked for arrived
//!   is never used again: its buffer must be empty when it comes back, and
//!   the socket must show nothing (neither bytes nor a close) when it is
//!   taken and at each sweep.
//! - **Idle connections are closed** once idle for `pool_idle_timeout_ms`:
//!   a sweep every quarter of it (at most every second, at least every
//!   25 ms), on a task that ends with the pool. One is never taken past it.
//! - **Bounded**: at most `pool_max_idle` idle connections in all (the
//!   client used longest ago gives one up to make room), and at most
//!   [`MAX_CLIENTS`] clients remembered (the one used longest ago is
//!   forgotten, its idle connections closed).
//!
//! A std mutex guards it all: held for a map operation, never across an
//! await; the check of a taken connection (a non-blocking read of its
//! socket) is made after the lock is let go.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::h1::{Conn, Home};

/// The most clients the pool keeps connections for at once.
pub(crate) const MAX_CLIENTS: usize = 1024;

/// Who a pooled connection may serve.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Client {
    /// The client's address, an IPv6 one cut to its /64 (`None`: a request
    /// made in process).
    net: Option<IpAddr>,
    /// The authenticated caller.
    caller: Option<crate::names::Holder>,
}

impl Client {
    /// The client at `ip`, as `caller`.
    pub(crate) fn new(ip: Option<IpAddr>, caller: Option<crate::names::Holder>) -> Self {
        let net = ip.map(|ip| match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
            },
            v4 => v4,
        });
        Self { net, caller }
    }
}

/// The pool.
#[derive(Debug)]
pub(crate) struct Pool {
    state: Mutex<State>,
    /// An idle connection older than this is closed.
    idle_timeout_ms: u64,
    /// The most idle connections kept, in all.
    max_idle: usize,
    /// The sweep's task was started.
    sweeping: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    clients: HashMap<Client, Entry>,
    /// Idle connections, in all.
    idle: usize,
    /// Counts uses, to tell which client was used longest ago.
    uses: u64,
}

#[derive(Debug)]
struct Entry {
    /// Its idle connections, the most recently used last.
    conns: Vec<Conn>,
    used: u64,
    home: Arc<ClientHome>,
}

/// Where a client's connections go back to.
#[derive(Debug)]
pub(crate) struct ClientHome {
    pool: Weak<Pool>,
    client: Client,
}

impl Home for ClientHome {
    fn put(&self, conn: Conn) {
        // Whatever the storage still holds back comes now, to be seen
        // before the connection's next use.
        conn.ack_now();
        if let Some(pool) = self.pool.upgrade() {
            pool.put(&self.client, conn);
        }
    }
}

impl Pool {
    pub(crate) fn new(idle_timeout_ms: u64, max_idle: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            idle_timeout_ms,
            max_idle,
            sweeping: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle connection of `client` that can take a request now (the
    /// most recently used first; the ones found closed, too old or with
    /// anything unasked for are closed on the way), and where a connection
    /// of `client` goes back to.
    pub(crate) fn take(self: &Arc<Self>, client: &Client) -> (Option<Conn>, Arc<ClientHome>) {
        if !self.sweeping.swap(true, Ordering::Relaxed) {
            tokio::spawn(sweep_until_gone(Arc::downgrade(self)));
        }
        let home = {
            let mut state = self.lock();
            state.uses += 1;
            let used = state.uses;
            if !state.clients.contains_key(client) {
                state.make_room_for_a_client();
                let home = Arc::new(ClientHome {
                    pool: Arc::downgrade(self),
                    client: client.clone(),
                });
                let conns = Vec::new();
                state
                    .clients
                    .insert(client.clone(), Entry { conns, used, home });
            }
            let entry = state.clients.get_mut(client).expect("just made");
            entry.used = used;
            entry.home.clone()
        };
        loop {
            let taken = {
                let mut state = self.lock();
                let conn = state.clients.get_mut(client).and_then(|e| e.conns.pop());
                state.idle -= usize::from(conn.is_some());
                conn
            };
            let Some(mut conn) = taken else {
                return (None, home);
            };
            if conn.is_open(self.idle_timeout_ms) && conn.is_quiet() {
                return (Some(conn), home);
            }
        }
    }

    /// Takes `conn` back for `client`, idle from now; the client used
    /// longest ago gives up a connection if the pool is full. Dropped
    /// (closed) if `client` was forgotten meanwhile.
    fn put(&self, client: &Client, conn: Conn) {
        let mut state = self.lock();
        if self.max_idle == 0 || !state.clients.contains_key(client) {
            return;
        }
        if state.idle >= self.max_idle {
            state.close_one_of_the_oldest_client();
        }
        if let Some(entry) = state.clients.get_mut(client) {
            entry.conns.push(conn);
            state.idle += 1;
        }
    }

    /// Closes the idle connections that are too old, or on which the
    /// storage closed or sent anything; forgets the clients left with none
    /// that no answer's body is using.
    fn sweep(&self) {
        let mut state = self.lock();
        let timeout = self.idle_timeout_ms;
        let mut closed = 0;
        state.clients.retain(|_, entry| {
            let before = entry.conns.len();
            entry
                .conns
                .retain_mut(|conn| conn.is_open(timeout) && conn.is_quiet());
            closed += before - entry.conns.len();
            // Kept while an exchange or an answer's body may bring one back.
            !entry.conns.is_empty()
                || Arc::strong_count(&entry.home) > 1
                || Arc::weak_count(&entry.home) > 0
        });
        state.idle -= closed;
    }

    /// How many idle connections it keeps.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.lock().idle
    }
}

impl State {
    /// Forgets the client used longest ago if [`MAX_CLIENTS`] are
    /// remembered, closing its idle connections.
    fn make_room_for_a_client(&mut self) {
        if self.clients.len() < MAX_CLIENTS {
            return;
        }
        let oldest = self
            .clients
            .iter()
            .min_by_key(|(_, e)| e.used)
            .map(|(c, _)| c.clone());
        if let Some(entry) = oldest.and_then(|c| self.clients.remove(&c)) {
            self.idle -= entry.conns.len();
        }
    }

    /// Closes the longest idle connection of the client used longest ago
    /// that has one.
    fn close_one_of_the_oldest_client(&mut self) {
        let oldest = self
            .clients
            .values_mut()
            .filter(|e| !e.conns.is_empty())
            .min_by_key(|e| e.used);
        if let Some(entry) = oldest {
            entry.conns.remove(0);
            self.idle -= 1;
        }
    }
}

/// Sweeps `pool` every quarter of its idle timeout (between 25 ms and a
/// second), until it is gone.
async fn sweep_until_gone(pool: Weak<Pool>) {
    let every_ms = match pool.upgrade() {
        Some(pool) => (pool.idle_timeout_ms / 4).clamp(25, 1_000),
        None => return,
    };
    let mut ticks = tokio::time::interval(Duration::from_millis(every_ms));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match pool.upgrade() {
            Some(pool) => pool.sweep(),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection to a listener that accepts and keeps it.
    async fn conn(listener: &tokio::net::TcpListener) -> (Conn, tokio::net::TcpStream) {
        let tcp = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (peer, _) = listener.accept().await.unwrap();
        (Conn::new(super::super::h1::Stream::Tcp(tcp), 8192), peer)
    }

    fn client(n: u8) -> Client {
        Client::new(Some(IpAddr::from([10, 0, 0, n])), None)
    }

    #[tokio::test]
    async fn idle_connections_and_clients_are_bounded() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(60_000, 3);
        let mut peers = Vec::new();
        for n in 1..=5 {
            let (_, home) = pool.take(&client(n));
            for _ in 0..2 {
                let (c, peer) = conn(&listener).await;
                peers.push(peer);
                home.put(c);
                assert!(pool.idle() <= 3);
            }
        }
        assert_eq!(pool.idle(), 3);
        // The clients used longest ago gave theirs up.
        let (taken, _) = pool.take(&client(5));
        assert!(taken.is_some());
        let (taken, _) = pool.take(&client(1));
        assert!(taken.is_none());
        for n in 0..=(MAX_CLIENTS + 10) {
            let c = Client::new(Some(IpAddr::from((n as u128).to_be_bytes())), None);
            pool.take(&c);
        }
        assert!(pool.lock().clients.len() <= MAX_CLIENTS);
    }

    #[tokio::test]
    async fn a_connection_that_got_anything_is_never_taken() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(60_000, 8);
        let (_, home) = pool.take(&client(1));
        let (c, mut peer) = conn(&listener).await;
        home.put(c);
        peer.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (taken, _) = pool.take(&client(1));
        assert!(
            taken.is_none(),
            "a connection with an answer nobody asked for"
        );
        assert_eq!(pool.idle(), 0);
    }

    #[test]
    fn an_ipv6_client_is_its_64() {
        let a = Client::new(Some("2001:db8:1:2:aaaa::1".parse().unwrap()), None);
        let b = Client::new(Some("2001:db8:1:2:bbbb::9".parse().unwrap()), None);
        let c = Client::new(Some("2001:db8:1:3::1".parse().unwrap()), None);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mapped = Client::new(Some("::ffff:10.0.0.7".parse().unwrap()), None);
        assert_eq!(mapped, Client::new(Some("10.0.0.7".parse().unwrap()), None));
        assert_ne!(
            Client::new(Some("10.0.0.7".parse().unwrap()), None),
            Client::new(Some("10.0.0.8".parse().unwrap()), None)
        );
    }
}
