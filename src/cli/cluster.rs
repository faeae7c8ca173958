//! `kestrel cluster scheduler|executor`: the processes of a Ballista cluster.

use super::*;

#[derive(clap::Subcommand)]
pub(crate) enum Role {
    /// The scheduler: plans the reads coordinators send and hands their tasks to executors.
    Scheduler {
        /// Address to listen on (port 0: a free port, printed on the first line).
        #[arg(long, default_value = "127.0.0.1:50050")]
        bind: String,
    },
    /// An executor: runs tasks for the scheduler, reading the warehouse's files itself.
    Executor {
        /// The scheduler's HOST:PORT (or df://HOST:PORT).
        #[arg(long)]
        scheduler: String,
        /// Address of this executor's data port (port 0: a free port, printed on the
        /// first line).
        #[arg(long, default_value = "127.0.0.1:0")]
        bind: String,
        /// Tasks run at once (default: one per core).
        #[arg(long)]
        concurrent_tasks: Option<usize>,
        /// The host name the scheduler reaches this executor at (default: the --bind
        /// address; set it when binding 0.0.0.0, e.g. in a container).
        #[arg(long)]
        external_host: Option<String>,
    },
}

/// `cfg`: the `--config` whose `[storage]` options the process opens the warehouse's
/// object stores with.
pub(super) async fn cluster(role: Role, cfg: Config) -> anyhow::Result<ExitCode> {
    let storage = cfg.storage;
    match role {
        Role::Scheduler { bind } => kestrel::engine::cluster::scheduler(&bind, storage).await?,
        Role::Executor {
            scheduler,
            bind,
            concurrent_tasks,
            external_host,
        } => {
            if concurrent_tasks == Some(0) {
                anyhow::bail!("--concurrent-tasks: expected a positive number of tasks");
            }
            let opts = kestrel::engine::cluster::ExecutorOptions {
                scheduler,
                bind,
                concurrent_tasks,
                external_host,
            };
            kestrel::engine::cluster::executor(opts, storage).await?
        }
    }
    Ok(ExitCode::SUCCESS)
}
