//! Before a run: is the configured scheduler there, and does it speak our plans?
//!
//! The check is one HTTP request to the scheduler's `/healthz` (served on its gRPC port),
//! whose `server` header names its Ballista version. It runs before anything is read or
//! committed, so an unreachable scheduler fails the run with nothing done — or, with
//! `fallback = "local"`, the run goes on in this process and says so.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::config::{scheduler_addr, EngineConfig, EngineKind, Fallback};
use super::port::ClusterPort;
use super::{EngineError, BALLISTA_VERSION};
use crate::error::Result;
use crate::sink::delta::Warehouse;

/// How long the scheduler has to answer the check.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The cluster port `engine` asks for over `wh`, or None to read in this process (the
/// local engine, or an unreachable scheduler with `fallback = "local"`).
pub async fn read_port(engine: &EngineConfig, wh: &Warehouse) -> Result<Option<ClusterPort>> {
    if engine.kind == EngineKind::Local {
        return Ok(None);
    }
    let url = engine.scheduler.clone().unwrap_or_default();
    match check(&url).await {
        Ok(endpoint) => {
            probe(&endpoint, &url).await?;
            tracing::info!(scheduler = %url, "reads and aggregates run on the cluster");
            Ok(Some(ClusterPort::new(
                wh.clone(),
                endpoint,
                engine.job_timeout,
            )))
        }
        Err(e @ EngineError::Unreachable { .. }) if engine.fallback == Fallback::Local => {
            tracing::warn!("{e}; running locally (engine.fallback = \"local\")");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// Check the scheduler at `url` (`df://host:port`); its gRPC endpoint
/// (`http://host:port`) when it answers with our Ballista version.
pub async fn check(url: &str) -> std::result::Result<String, EngineError> {
    let unreachable = |reason: String| EngineError::Unreachable {
        url: url.to_string(),
        reason,
    };
    let (host, port) = scheduler_addr(url).map_err(unreachable)?;
    let head = tokio::time::timeout(CHECK_TIMEOUT, healthz(&host, port))
        .await
        .map_err(|_| unreachable(format!("no answer within {}s", CHECK_TIMEOUT.as_secs())))?
        .map_err(|e| unreachable(e.to_string()))?;
    let status_ok = head.lines().next().is_some_and(|l| l.contains(" 200"));
    if !status_ok {
        let first = head.lines().next().unwrap_or("").to_string();
        return Err(unreachable(format!(
            "/healthz answered {first:?}, not 200 (is it a ballista scheduler?)"
        )));
    }
    let theirs = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        let v = v.trim();
        (k.eq_ignore_ascii_case("server") && v.starts_with("ballista/"))
            .then(|| v.trim_start_matches("ballista/").to_string())
    });
    match theirs {
        Some(v) if v == BALLISTA_VERSION => Ok(format!("http://{host}:{port}")),
        Some(v) => Err(EngineError::VersionMismatch {
            url: url.to_string(),
            theirs: v,
            ours: BALLISTA_VERSION.into(),
        }),
        None => Err(unreachable(
            "it answered, but not as a ballista scheduler (no `server: ballista/…` header)".into(),
        )),
    }
}

/// How long the version probe may wait for the cluster to run it.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);

/// Send the scheduler at `endpoint` (`http://host:port`, `url` as configured) a plan
/// carrying this process's kestrel version (an empty in-memory table, [`super::codec`]):
/// a scheduler of another kestrel version refuses it as it decodes it, with both versions
/// named. Executors do the same when they start ([`refused`]), so every process of a
/// working cluster runs one kestrel version. An error that is not a refusal is left to
/// the run (the probe then costs nothing more than a failed job).
pub async fn probe(endpoint: &str, url: &str) -> std::result::Result<(), EngineError> {
    let ctx = super::port::cluster_session(endpoint, None, &Default::default()); // bounded below
    let schema = std::sync::Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("v", arrow::datatypes::DataType::Utf8, true),
    ]));
    let empty = datafusion::datasource::MemTable::try_new(schema, vec![vec![]]);
    let query = async {
        let t = empty?;
        ctx.read_table(std::sync::Arc::new(t))?.count().await
    };
    match tokio::time::timeout(PROBE_TIMEOUT, query).await {
        Ok(Err(e)) => {
            let text = e.to_string();
            match text.find("a plan encoded by kestrel") {
                Some(i) => {
                    let reason: String = text[i..]
                        .chars()
                        .take_while(|c| !matches!(c, '"' | ')' | '\n'))
                        .collect();
                    Err(EngineError::Refused {
                        url: url.to_string(),
                        ours: super::kestrel_version().to_string(),
                        reason,
                    })
                }
                None => {
                    tracing::warn!(scheduler = %url, error = %text, "the cluster's version probe failed");
                    Ok(())
                }
            }
        }
        Ok(Ok(_)) => Ok(()),
        Err(_) => {
            tracing::warn!(scheduler = %url, "the cluster did not run the version probe within 60 s");
            Ok(())
        }
    }
}

/// For an executor: wait until the scheduler at `url` answers, then probe it
/// ([`probe`]); resolves only with the scheduler's refusal (or a Ballista version
/// mismatch), so the executor stops.
pub async fn refused(url: &str) -> EngineError {
    let mut waited = 0;
    let endpoint = loop {
        match check(url).await {
            Ok(e) => break e,
            Err(e @ EngineError::VersionMismatch { .. }) => return e,
            Err(e) => {
                waited += 1;
                if waited == 60 {
                    tracing::warn!(error = %e, "the scheduler does not answer its version check");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    match probe(&endpoint, url).await {
        Err(e) => e,
        Ok(()) => std::future::pending().await,
    }
}

/// The status line and headers of `GET /healthz` on `host:port`.
async fn healthz(host: &str, port: u16) -> std::io::Result<String> {
    let mut s = tokio::net::TcpStream::connect((host, port)).await?;
    let req = format!("GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    Ok(text.split("\r\n\r\n").next().unwrap_or("").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nothing listening: a one-line error naming the URL; anything else answering is
    /// not taken for a scheduler.
    #[tokio::test]
    async fn an_unreachable_or_foreign_scheduler_is_named() {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let url = format!("df://127.0.0.1:{port}");
        let e = check(&url).await.unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("ballista scheduler {url} is unreachable")),
            "{e}"
        );
        assert!(!e.contains('\n'));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut b = [0u8; 512];
            let _ = s.read(&mut b).await;
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\nserver: nginx\r\ncontent-length: 0\r\n\r\n")
                .await;
        });
        let e = check(&format!("df://127.0.0.1:{port}"))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("not as a ballista scheduler"), "{e}");
    }
}
