//! The daemon's HTTP endpoint: `GET /healthz` and `GET /metrics`, served by hyper's
//! HTTP/1.1 server: keep-alive (a scraper reuses its connection), request heads limited
//! to [`MAX_HEAD_BYTES`] and read within [`HEAD_TIMEOUT`], a connection closed after
//! [`CONNECTION_TIMEOUT`], at most [`MAX_CONNECTIONS`] at once (more are refused).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use crate::error::{Error, Result};

/// Largest request head (request line and headers) accepted.
pub const MAX_HEAD_BYTES: usize = 16 << 10;
/// A request head (also the next one on a kept-alive connection) must arrive within this.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection is closed after this, whatever it is doing.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(120);
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;

/// A response: status code, content type and body.
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

/// Bind `addr` (an error names it) and return the listener and its actual address.
pub async fn bind(addr: &str) -> Result<(TcpListener, std::net::SocketAddr)> {
    let l = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::io(format!("cannot listen on {addr}"), e))?;
    let local = l
        .local_addr()
        .map_err(|e| Error::io(format!("cannot listen on {addr}"), e))?;
    Ok((l, local))
}

/// Serve requests on `listener` forever: `handle(path)` answers each GET.
pub async fn serve<F, Fut>(listener: TcpListener, handle: F)
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response> + Send + 'static,
{
    let handle = Arc::new(handle);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "http accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            warn!(%peer, limit = MAX_CONNECTIONS, "http: too many connections; refused");
            continue;
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = service_fn(move |req: Request<Incoming>| {
                let handle = handle.clone();
                async move { Ok::<_, Infallible>(respond(req, handle.as_ref()).await) }
            });
            let mut builder = http1::Builder::new();
            builder
                .keep_alive(true)
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, error = %e, "http connection ended"),
                Err(_) => debug!(%peer, "http connection closed after the connection timeout"),
            }
        });
    }
}

/// One request: GET answered by `handle(path)`, anything else 405.
async fn respond<F, Fut>(req: Request<Incoming>, handle: &F) -> hyper::Response<Full<Bytes>>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Response>,
{
    debug!(method = %req.method(), path = %req.uri().path(), "http request");
    let r = if req.method() != Method::GET {
        Response::text(405, "only GET\n")
    } else {
        handle(req.uri().path().to_string()).await
    };
    let mut out = hyper::Response::new(Full::new(Bytes::from(r.body)));
    *out.status_mut() = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    out.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(r.content_type),
    );
    if r.status == 405 {
        out.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Two requests on one kept-alive connection, a 405 with `Allow`, and a request head
    /// over the limit refused.
    #[tokio::test]
    async fn serves_keep_alive_and_limits_requests() {
        let (l, addr) = bind("127.0.0.1:0").await.unwrap();
        tokio::spawn(serve(l, |path: String| async move {
            Response::text(200, format!("at {path}\n"))
        }));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut got = Vec::new();
        for path in ["/a", "/b"] {
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        assert!(
            got[0].starts_with("HTTP/1.1 200") && got[0].ends_with("at /a\n"),
            "{got:?}"
        );
        assert!(got[1].ends_with("at /b\n"), "{got:?}");
        s.write_all(
            b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let mut rest = String::new();
        s.read_to_string(&mut rest).await.unwrap();
        assert!(
            rest.starts_with("HTTP/1.1 405") && rest.contains("allow: GET"),
            "{rest}"
        );
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let big = format!(
            "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(64 << 10)
        );
        let _ = s.write_all(big.as_bytes()).await;
        let mut rest = String::new();
        let _ = s.read_to_string(&mut rest).await;
        assert!(
            rest.is_empty() || rest.starts_with("HTTP/1.1 431"),
            "{rest}"
        );
    }
}
