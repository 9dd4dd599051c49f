//! fencegate in front of a Java servlet container (embedded Tomcat 10, from
//! Debian's libtomcat10-java). Tomcat drops `;parameters` from each path
//! segment and then resolves dot segments, so `/kv/orders/..;/payments/x`
//! is the key `/kv/payments/x` to a servlet: a write admitted for lease
//! `orders` would land in lease `payments`' keys. The test shows each such
//! path landing there when sent straight to Tomcat, and refused through
//! fencegate with nothing stored. (Seen failing before the path model in
//! `src/route.rs`: every one of them was admitted and landed.)

mod support;

use fencegate::backend::{Backend, EmbeddedStore, Upstream};
use fencegate::clock::ClockKind;
use fencegate::config::Config;
use support::servers::tomcat;
use support::{spawn, Harness, HttpClient, Req};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_never_lands_outside_its_lease_behind_a_servlet_container() {
    let tomcat = tomcat().await;
    let config = Config {
        clock: ClockKind::Manual,
        upstream: tomcat.url.clone(),
        ..Config::default()
    };
    let up = Upstream::new(&tomcat.url.parse().unwrap(), &config.upstream_options()).unwrap();
    let h = Harness::with_backend(config, Backend::Upstream(up), EmbeddedStore::new());
    let fg = spawn(h.app.clone()).await;
    let through = HttpClient::new(&fg.url());
    let direct = HttpClient::new(&tomcat.url);
    let orders = h.acquire("orders", "A", 60_000).await;
    let zz = h.acquire("zz", "Z", 60_000).await;

    // A write of orders under its own keys lands where it should.
    let r = through
        .send(Req::new("PUT", "/kv/orders/1").held(&orders).body("mine"))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        direct.send(Req::new("GET", "/kv/orders/1")).await.text(),
        "mine"
    );

    // (path, lease whose term sends it, the key Tomcat stores it under)
    let tricks = [
        ("/kv/orders/..;/payments/x1", &orders, "/kv/payments/x1"),
        ("/kv/orders/%2e%2e;/payments/x2", &orders, "/kv/payments/x2"),
        ("/kv/orders/..;x=1/payments/x3", &orders, "/kv/payments/x3"),
        ("/kv/orders/.%2E;/payments/x4", &orders, "/kv/payments/x4"),
        ("/kv/zz/..;/..;/outside/v5", &zz, "/outside/v5"),
    ];
    for (path, held, lands_at) in tricks {
        // Straight to Tomcat (as fencegate with the check switched off
        // would send it): the write lands in another lease's keys.
        let r = direct
            .send(Req::new("PUT", path).held(held).body("direct"))
            .await;
        assert_eq!(r.status, 201, "{path} straight to Tomcat: {}", r.text());
        let stored = direct.send(Req::new("GET", lands_at)).await;
        assert_eq!(
            (stored.status.as_u16(), stored.text().as_str()),
            (200, "direct"),
            "{path} did not land at {lands_at}: the harness would not see the hole"
        );
        let r = direct.send(Req::new("DELETE", lands_at)).await;
        assert_eq!(r.status, 204);

        // Through fencegate: refused, never forwarded.
        let r = through
            .send(Req::new("PUT", path).held(held).body("through"))
            .await;
        assert_eq!(r.status, 400, "{path} through fencegate: {}", r.text());
        assert_eq!(r.reason(), "invalid-request");
        let stored = direct.send(Req::new("GET", lands_at)).await;
        assert_eq!(
            stored.status, 404,
            "{path} reached {lands_at} through fencegate"
        );
    }
    // The same tricks in reads and deletes are refused too.
    let r = through
        .send(Req::new("DELETE", "/kv/orders/..;/orders/1").held(&orders))
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        direct.send(Req::new("GET", "/kv/orders/1")).await.text(),
        "mine"
    );
    fg.stop().await;
}
