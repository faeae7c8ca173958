//! The `kestrel` command line: parses arguments and calls the library. Exit codes:
//! 0 ok; 1 error (one-line reason on stderr); 2 bad command line; 3 finished, but some
//! landed files were rejected whole or changed after processing (see the run log);
//! 4 `status --check`: a gold table is staler than `--max-age`.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

mod cli;

fn init_tracing(verbose: u8) {
    // Ballista's client logs a failed cluster job as an error before returning it; kestrel
    // reports that error itself, on one line.
    let default = match verbose {
        0 => "warn,deltalake_core=error,deltalake=error,buoyant_kernel=off,ballista_core::execution_plans::distributed_query=off",
        1 => "info,kestrel=info,deltalake_core=error,buoyant_kernel=off,datafusion=warn,ballista_core::execution_plans::distributed_query=off",
        _ => "debug,kestrel=debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .compact()
        .init();
}

fn main() -> ExitCode {
    kestrel::alloc::tune();
    let cli = cli::Cli::parse();
    init_tracing(cli.verbose);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kestrel: cannot start runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(cli::dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            // One line: the chain of causes joined.
            let msg = e
                .chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": ");
            eprintln!("kestrel: {}", msg.replace('\n', " "));
            ExitCode::from(1)
        }
    }
}
