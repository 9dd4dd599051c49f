//! `fencegate serve` started in process through `serve::start`: the same
//! start-up as the binary (journal recovery, backend, app, listeners), its
//! addresses known before anyone connects, stopped through its shutdown
//! input, and its start-up errors typed.

mod support;

use fencegate::config::Config;
use fencegate::serve::{self, StartError, StartOptions};
use support::proc::TempDir;
use support::{held_from, HttpClient, Req};

/// Starts fencegate on `config`, waiting while a fencegate stopped just
/// before still holds the data directory: its journal writer is a thread
/// that lets go of the directory's lock once it sees the store dropped. Real
/// time, because that thread runs on it; 20 s is far beyond what it takes.
async fn start(config: Config, options: StartOptions) -> Result<serve::Bound, StartError> {
    let mut attempts = 1000; // 20 ms apart: 20 s
    loop {
        attempts -= 1;
        match serve::start(config.clone(), options).await {
            Err(StartError::Journal(e)) if e.to_string().contains("in use") && attempts > 0 => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

fn config(data: &TempDir) -> Config {
    Config {
        listen: "127.0.0.1:0".into(),
        data_dir: data.path().join("data"),
        ..Config::default()
    }
}

#[tokio::test]
async fn serves_a_fenced_write_and_stops_when_told() {
    let data = TempDir::new("serve-in-process");
    let bound = start(config(&data), StartOptions::default()).await.unwrap();
    let base = format!("http://{}", bound.local_addr().unwrap());
    assert!(bound.admin_addr().is_none());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(bound.serve(async {
        let _ = stopped.await;
    }));

    let client = HttpClient::new(&base);
    let r = client
        .send(
            Req::new("POST", "/_fence/leases/orders")
                .json(serde_json::json!({"holder": "a", "ttl_ms": 60_000})),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let held = held_from(&r);
    let r = client
        .send(Req::new("PUT", "/kv/orders").held(&held).body("one"))
        .await;
    assert!(r.status.is_success(), "{} {}", r.status, r.text());
    let r = client.send(Req::new("GET", "/kv/orders")).await;
    assert_eq!(r.text(), "one");

    stop.send(()).unwrap();
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(20), serving)
        .await
        .expect("serve returns once its shutdown input completes");
    stopped.unwrap().unwrap();
    assert!(
        client
            .try_send(Req::new("GET", "/kv/orders"))
            .await
            .is_err(),
        "the listener is closed"
    );

    // A second start on the same data directory continues the tokens.
    let bound = start(config(&data), StartOptions::default()).await.unwrap();
    let base = format!("http://{}", bound.local_addr().unwrap());
    let serving = tokio::spawn(bound.serve(std::future::pending()));
    let r = HttpClient::new(&base)
        .send(
            Req::new("POST", "/_fence/leases/orders")
                .json(serde_json::json!({"holder": "b", "ttl_ms": 60_000})),
        )
        .await;
    serving.abort();
    // The first term is still live after the restart: b waits it out or
    // is refused, and no token of a's is reissued.
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.reason(), "lease-held");
}

#[tokio::test]
async fn start_up_errors_say_what_failed() {
    let data = TempDir::new("serve-errors");
    let first = start(config(&data), StartOptions::default()).await.unwrap();
    let taken = first.local_addr().unwrap();

    let busy = Config {
        listen: taken.to_string(),
        data_dir: data.path().join("other"),
        ..Config::default()
    };
    match serve::start(busy, StartOptions::default()).await {
        Err(err @ StartError::Listen("listen", ..)) => {
            assert!(err.to_string().contains(&taken.to_string()), "{err}");
        }
        Err(other) => panic!("expected a listen error, got {other}"),
        Ok(_) => panic!("a second listener bound a taken port"),
    }
    drop(first);

    // The journal gone while store.meta remains: refused, not started afresh.
    std::fs::remove_file(data.path().join("data/journal.log")).unwrap();
    match start(config(&data), StartOptions::default()).await {
        Err(StartError::Journal(err)) => {
            assert!(err.to_string().contains("accept-journal-loss"), "{err}");
        }
        Err(other) => panic!("expected a journal error, got {other}"),
        Ok(_) => panic!("started without its journal"),
    }
    let options = StartOptions {
        accept_journal_loss: true,
        ..StartOptions::default()
    };
    start(config(&data), options).await.unwrap();
}
