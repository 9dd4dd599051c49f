//! A relay between fencegate and the storage that passes every request on,
//! except the one write it is armed to hold: it keeps that request (the
//! connection it came on may close) until the test delivers it, late, as
//! a request that sat in a queue, a retrying load balancer or a paused
//! proxy would arrive.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::BodyExt as _;

use super::{spawn, HttpClient, Req, Resp, Running};

/// The headers a held or passed request keeps (the storage reads them).
const KEPT: [&str; 3] = ["authorization", "content-type", "x-amz-target"];

/// A request as the relay took it.
#[derive(Clone, Debug)]
pub struct Held {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

#[derive(Clone)]
pub struct HoldingRelay {
    storage: String,
    armed: Arc<AtomicBool>,
    /// Which requests may be held (a write, not a read).
    holds: Arc<dyn Fn(&Held) -> bool + Send + Sync>,
    held: Arc<Mutex<Option<Held>>>,
    pub got: Arc<tokio::sync::Notify>,
}

fn kept(headers: &HeaderMap) -> Vec<(String, String)> {
    KEPT.iter()
        .filter_map(|name| {
            let v = headers.get(*name)?.to_str().ok()?;
            Some(((*name).to_owned(), v.to_owned()))
        })
        .collect()
}

impl HoldingRelay {
    /// A relay on a free loopback port to `storage`, holding (once armed)
    /// the next `POST` that `holds` picks.
    pub async fn start(
        storage: &str,
        holds: impl Fn(&Held) -> bool + Send + Sync + 'static,
    ) -> (Self, Running) {
        let relay = Self {
            storage: storage.to_owned(),
            armed: Arc::default(),
            holds: Arc::new(holds),
            held: Arc::default(),
            got: Arc::default(),
        };
        let state = relay.clone();
        let app = tower::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let state = state.clone();
            async move {
                let (parts, body) = req.into_parts();
                let request = Held {
                    path: parts.uri.path().to_owned(),
                    headers: kept(&parts.headers),
                    body: body.collect().await.unwrap().to_bytes(),
                };
                if parts.method == http::Method::POST
                    && (state.holds)(&request)
                    && state.armed.swap(false, Ordering::SeqCst)
                {
                    *state.held.lock().unwrap() = Some(request);
                    state.got.notify_one();
                    std::future::pending::<()>().await;
                    unreachable!();
                }
                let r = state.send(&parts.method, request).await;
                let mut res = http::Response::new(fencegate::body::full(r.body));
                *res.status_mut() = r.status;
                if let Some(ct) = r.headers.get(http::header::CONTENT_TYPE) {
                    res.headers_mut()
                        .insert(http::header::CONTENT_TYPE, ct.clone());
                }
                Ok::<_, std::convert::Infallible>(res)
            }
        });
        let running = spawn(app).await;
        (relay, running)
    }

    async fn send(&self, method: &http::Method, request: Held) -> Resp {
        let mut req = Req::new(method.as_str(), &request.path).body(request.body);
        for (k, v) in &request.headers {
            req = req.header(k, v);
        }
        HttpClient::new(&self.storage).send(req).await
    }

    /// Holds the next request it may hold.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Sends the held request to the storage now: the storage's answer.
    pub async fn deliver(&self) -> Resp {
        let held = self.held.lock().unwrap().take().expect("a held request");
        self.send(&http::Method::POST, held).await
    }
}
