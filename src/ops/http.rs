//! The daemon's HTTP endpoint: `GET /healthz` and `GET /metrics`, HTTP/1.1 on a plain
//! TCP listener (one request per connection; enough for probes and Prometheus scrapes,
//! without a web framework in the build).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::error::{Error, Result};

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

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Error",
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
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "http accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut reader = BufReader::new(read);
            let mut line = String::new();
            let read = tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut line));
            if !matches!(read.await, Ok(Ok(n)) if n > 0) {
                return;
            }
            // Drain the headers (up to the blank line).
            loop {
                let mut h = String::new();
                match tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut h)).await {
                    Ok(Ok(n)) if n > 0 && h.trim_end() != "" => continue,
                    _ => break,
                }
            }
            let mut parts = line.split_whitespace();
            let method = parts.next().unwrap_or("");
            let path = parts.next().unwrap_or("/").to_string();
            debug!(%peer, method, path = %path, "http request");
            let resp = if method != "GET" {
                Response::text(405, "only GET\n")
            } else {
                let path = path.split('?').next().unwrap_or("/").to_string();
                handle(path).await
            };
            let head = format!(
                "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                resp.status,
                reason(resp.status),
                resp.content_type,
                resp.body.len()
            );
            let _ = write.write_all(head.as_bytes()).await;
            let _ = write.write_all(resp.body.as_bytes()).await;
            let _ = write.shutdown().await;
        });
    }
}
