//! `kestrel cluster scheduler|executor`: Ballista's scheduler and executor embedded in
//! the kestrel binary, with kestrel's plan codec registered ([`super::codec`]), so a
//! cluster always runs the same code as the coordinator that sends it plans.
//!
//! Port 0 asks for a free port; the address taken is the first line of output.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::Arc;

use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::SessionStateBuilder;

use ballista_executor::executor_process::{start_executor_process, ExecutorProcessConfig};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::SchedulerConfig;
use ballista_scheduler::scheduler_process::{create_scheduler, start_grpc_service_with_listener};
use datafusion_proto::protobuf::{LogicalPlanNode, PhysicalPlanNode};

use super::{codec, kestrel_version, EngineError, BALLISTA_VERSION};
use crate::error::Result;

/// An executor silent for this long is taken for dead.
const EXECUTOR_TIMEOUT_S: u64 = 20;

fn process_error(what: impl Into<String>) -> impl FnOnce(String) -> EngineError {
    let what = what.into();
    move |reason| EngineError::Process { what, reason }
}

fn parse_bind(what: &str, bind: &str) -> std::result::Result<SocketAddr, EngineError> {
    bind.parse::<SocketAddr>()
        .map_err(|e| EngineError::Process {
            what: format!("{what} --bind {bind:?}"),
            reason: format!("expected HOST:PORT with an IP address, e.g. 127.0.0.1:50050 ({e})"),
        })
}

/// Run a scheduler on `bind` (`HOST:PORT`) until the process is stopped, opening the
/// warehouse's object stores with `storage` ([`super::stores`]). Prints
/// `scheduler df://HOST:PORT …` first.
pub async fn scheduler(bind: &str, storage: BTreeMap<String, String>) -> Result<()> {
    let addr = parse_bind("scheduler", bind)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| process_error(format!("scheduler: bind {addr}"))(e.to_string()))?;
    let addr = listener
        .local_addr()
        .map_err(|e| process_error("scheduler")(e.to_string()))?;
    println!(
        "scheduler df://{addr} (kestrel {}, ballista {BALLISTA_VERSION})",
        kestrel_version()
    );
    let mut config = SchedulerConfig::default()
        .with_hostname(addr.ip().to_string())
        .with_port(addr.port());
    config.bind_host = addr.ip().to_string();
    config.override_logical_codec = Some(codec::logical());
    config.override_physical_codec = Some(codec::physical());
    // Executors heartbeat every 5 s (see `executor`): one silent for 20 s is gone, and
    // the tasks it was running are handed to the others (Ballista's default waits 3 min).
    config.executor_timeout_seconds = EXECUTOR_TIMEOUT_S;
    config.expire_dead_executor_interval_seconds = 5;
    config.no_executors_grace_period_seconds = EXECUTOR_TIMEOUT_S;
    // It lists and reads file footers while planning: with the warehouse's stores.
    super::stores::set_process_options(storage.clone());
    let stores = Arc::new(super::stores::WarehouseStores::new(storage));
    config.override_session_builder = Some(Arc::new(move |session_config| {
        let state = ballista_core::utils::default_session_builder(session_config)?;
        let runtime = RuntimeEnvBuilder::new()
            .with_object_store_registry(stores.clone())
            .build()?;
        Ok(SessionStateBuilder::new_from_existing(state)
            .with_runtime_env(Arc::new(runtime))
            .build())
    }));
    let cluster = BallistaCluster::new_from_config(&config)
        .await
        .map_err(|e| process_error("scheduler")(e.to_string()))?;
    let server = create_scheduler::<LogicalPlanNode, PhysicalPlanNode>(cluster, Arc::new(config))
        .await
        .map_err(|e| process_error("scheduler")(e.to_string()))?;
    start_grpc_service_with_listener(listener, server)
        .await
        .map_err(|e| process_error("scheduler")(e.to_string()))?;
    Ok(())
}

/// A free TCP port on `ip` (bound and released: the executor binds it again).
fn free_port(ip: std::net::IpAddr) -> std::result::Result<u16, EngineError> {
    StdListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| process_error(format!("executor: find a free port on {ip}"))(e.to_string()))
}

/// How an executor runs (`kestrel cluster executor`).
#[derive(Debug, Clone)]
pub struct ExecutorOptions {
    /// The scheduler, `HOST:PORT` or `df://HOST:PORT`.
    pub scheduler: String,
    /// `HOST:PORT` of its Arrow Flight port (its task port is the next free one).
    pub bind: String,
    /// Tasks at once (default: one per core).
    pub concurrent_tasks: Option<usize>,
    /// The name the scheduler reaches it at (default: the bind address).
    pub external_host: Option<String>,
}

/// Run an executor as `opts` say, reading the warehouse with `storage`
/// ([`super::stores`]). Prints `executor HOST:PORT …` first.
pub async fn executor(opts: ExecutorOptions, storage: BTreeMap<String, String>) -> Result<()> {
    let ExecutorOptions {
        scheduler,
        bind,
        concurrent_tasks,
        external_host,
    } = opts;
    let url = if scheduler.contains("://") {
        scheduler.clone()
    } else {
        format!("df://{scheduler}")
    };
    let (scheduler_host, scheduler_port) =
        super::config::scheduler_addr(&url).map_err(process_error("executor --scheduler"))?;
    let addr = parse_bind("executor", &bind)?;
    let external_host = external_host.unwrap_or_else(|| addr.ip().to_string());
    let port = match addr.port() {
        0 => free_port(addr.ip())?,
        p => p,
    };
    let grpc_port = free_port(addr.ip())?;
    let vcores = concurrent_tasks.unwrap_or_else(crate::config::default_parallel_jobs);
    println!(
        "executor {external_host}:{port} (scheduler {scheduler_host}:{scheduler_port}, {vcores} concurrent tasks, kestrel {}, ballista {BALLISTA_VERSION})",
        kestrel_version()
    );
    // Shuffle files and spills.
    let work_dir = std::env::temp_dir().join(format!("kestrel-executor-{port}"));
    std::fs::create_dir_all(&work_dir).map_err(|e| {
        process_error(format!("executor: create {}", work_dir.display()))(e.to_string())
    })?;
    super::stores::set_process_options(storage.clone());
    let stores = Arc::new(super::stores::WarehouseStores::new(storage));
    let spill_dir = work_dir.clone();
    let scheduler_url = format!("df://{scheduler_host}:{scheduler_port}");
    let config = ExecutorProcessConfig {
        work_dir: Some(work_dir.to_string_lossy().into_owned()),
        override_runtime_producer: Some(Arc::new(move |_| {
            Ok(Arc::new(
                RuntimeEnvBuilder::new()
                    .with_temp_file_path(spill_dir.clone())
                    .with_object_store_registry(stores.clone())
                    .build()?,
            ))
        })),
        bind_host: addr.ip().to_string(),
        external_host: Some(external_host),
        port,
        grpc_port,
        scheduler_host,
        scheduler_port,
        // Keep trying while the scheduler starts.
        scheduler_connect_timeout_seconds: 30,
        vcores,
        print_thread_info: false,
        // A lost executor is noticed within seconds, not a minute.
        executor_heartbeat_interval_seconds: 5,
        override_logical_codec: Some(codec::logical()),
        override_physical_codec: Some(codec::physical()),
        ..Default::default()
    };
    // It serves until stopped; meanwhile it checks that the scheduler runs its kestrel
    // version (Ballista's registration carries no such thing), and stops if not.
    let serve = start_executor_process(Arc::new(config));
    let outcome: Result<()> = tokio::select! {
        r = serve => r.map_err(|e| process_error("executor")(e.to_string()).into()),
        e = super::connect::refused(&scheduler_url) => Err(e.into()),
    };
    // Stopped (Ctrl+C, SIGTERM, the scheduler's stop request, or a version mismatch):
    // its shuffle files and spills go with it. (A SIGKILLed executor leaves the
    // directory; the next executor on that port reuses it.)
    if let Err(e) = std::fs::remove_dir_all(&work_dir) {
        tracing::debug!(dir = %work_dir.display(), error = %e, "executor: work directory left");
    }
    outcome
}
