//! `kestrel demo`: generate realistic landed events.

use super::*;

pub(super) fn demo(cfg: Config, hours: f64, scale: f64, seed: u64) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        hours > 0.0 && hours <= 24.0 * 30.0,
        "--hours must be between 0 and 720"
    );
    anyhow::ensure!(scale > 0.0, "--scale must be positive");
    anyhow::ensure!(
        !cfg.landing.contains("://") || cfg.landing.starts_with("file://"),
        "demo writes to a local landing zone; landing is {}",
        cfg.landing
    );
    let dir = PathBuf::from(cfg.landing.trim_start_matches("file://"));
    let opts = kestrel::demo::DemoOptions {
        hours,
        scale,
        seed,
        ..Default::default()
    };
    let report = kestrel::demo::generate(&dir, &opts)
        .with_context(|| format!("writing demo events to {}", dir.display()))?;
    println!("wrote demo events to {}", dir.display());
    for (s, (files, lines)) in &report.per_source {
        println!("  {s:<12} {files:>5} files {lines:>8} lines");
    }
    println!(
        "  including {} re-delivered events and {} malformed lines; next: kestrel run",
        report.duplicates, report.malformed
    );
    Ok(ExitCode::SUCCESS)
}
