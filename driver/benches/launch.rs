//! Launch latency: the time from starting `driver` until every rank is running, on 1 and on 4
//! hosts (loopback addresses served by a real sshd, each its own SSH connection), against starting
//! the same containers one at a time with the docker CLI over ssh, as PipeDream's launcher did.
//!
//! `cargo bench -p stagehand-driver --bench launch` (needs Docker, sshd and the base image; the
//! fake rank is built by `cargo build -p stagehand-driver --bin fake-rank` in the same profile).

#[allow(dead_code)] // shared with the tests, which use all of it
#[path = "../tests/util/sshd.rs"]
mod sshd;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const REPEATS: usize = 3;

fn target_dir() -> PathBuf {
    // benches run from target/<profile>/deps/; the binaries sit one level up.
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn write_config(dir: &Path, name: &str, hosts: &[&str], fake_rank: &Path, context: &Path) -> PathBuf {
    let path = dir.join(format!("{name}.yml"));
    std::fs::write(
        &path,
        format!(
            "name: {name}\nmachines: [{}]\ncontainer: {{build: '{}'}}\ncommand: ['{}', --iterations, '1', --hang]\n",
            hosts.join(", "),
            context.display(),
            fake_rank.display()
        ),
    )
    .unwrap();
    path
}

/// Starts the driver, returns the time until it reported every rank started; then interrupts it.
fn driver_launch(driver: &Path, config: &Path, ssh_config: &Path, out: &Path, ranks: usize) -> Duration {
    let start = Instant::now();
    let mut child = Command::new(driver)
        .arg("--config-file")
        .arg(config)
        .arg("--ssh-config")
        .arg(ssh_config)
        .arg("--output-dir")
        .arg(out)
        .args(["-v", "--no-progress"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start driver");
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut started = 0;
    let mut elapsed = None;
    for line in stderr.lines() {
        let line = line.unwrap();
        if line.starts_with("driver: rank ") && line.contains(" started on ") {
            started += 1;
            if started == ranks {
                elapsed = Some(start.elapsed());
                let _ = Command::new("kill")
                    .args(["-INT", &child.id().to_string()])
                    .status();
            }
        }
        if line.starts_with("error:") && elapsed.is_none() {
            panic!("driver failed: {line}");
        }
    }
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "the driver is interrupted after launch");
    elapsed.expect("every rank started")
}

/// PipeDream's way: one `ssh host docker run -d ...` after another (or, with `parallel`, all at
/// once: the floor this machine allows, since every "host" here shares its two cores and engine).
fn cli_launch(
    hosts: &[&str],
    ssh_config: &Path,
    image: &str,
    fake_rank: &Path,
    label: &str,
    parallel: bool,
) -> Duration {
    let start = Instant::now();
    let mut running = Vec::new();
    let mount = format!("{0}:{0}:ro", fake_rank.display());
    for (rank, host) in hosts.iter().enumerate() {
        let rank_env = format!("RANK={rank}");
        let docker_run = [
            "docker",
            "run",
            "-d",
            "--network",
            "host",
            "--label",
            label,
            "-v",
            &mount,
            "-e",
            &rank_env,
        ];
        let mut child = Command::new("ssh")
            .arg("-F")
            .arg(ssh_config)
            .arg(host)
            .args(docker_run)
            .arg(image)
            .arg(fake_rank)
            .args(["--iterations", "1", "--hang"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        if parallel {
            running.push(child);
        } else {
            assert!(child.wait().unwrap().success());
        }
    }
    for mut child in running {
        assert!(child.wait().unwrap().success());
    }
    let elapsed = start.elapsed();
    let ids = Command::new("docker")
        .args(["ps", "-aq", "--filter", &format!("label={label}")])
        .output()
        .unwrap();
    for id in String::from_utf8_lossy(&ids.stdout).lines() {
        Command::new("docker")
            .args(["rm", "-f", id])
            .stdout(Stdio::null())
            .status()
            .unwrap();
    }
    elapsed
}

fn main() {
    let bin = target_dir();
    let driver = bin.join("driver");
    let fake_rank = bin.join("fake-rank");
    assert!(
        driver.exists() && fake_rank.exists(),
        "build the driver and fake-rank in this profile first"
    );
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let status = Command::new(workspace.join("scripts/base-image.sh"))
        .status()
        .unwrap();
    assert!(status.success());
    let context = workspace.join("docker/local");
    let sshd = sshd::Sshd::start();
    let scratch = tempfile::tempdir().unwrap();

    // Warm-up: builds the image (not part of the measurement) and tells its tag.
    let warm = write_config(
        scratch.path(),
        "bench-warm",
        &sshd::TRUSTED[..1],
        &fake_rank,
        &context,
    );
    let out = scratch.path().join("warm");
    driver_launch(&driver, &warm, &sshd.config(), &out, 1);
    let record = std::fs::read_dir(&out).unwrap().next().unwrap().unwrap().path();
    let hosts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(record.join("hosts.json")).unwrap()).unwrap();
    let image = hosts[0]["image"].as_str().unwrap().to_string();

    println!("launch until every rank runs (median of {REPEATS}), one rank per host, hosts over SSH:");
    println!(
        "{:>6}  {:>10}  {:>18}  {:>20}",
        "hosts", "driver", "docker CLI 1-by-1", "docker CLI all at once"
    );
    for n in [1usize, 4] {
        let hosts = &sshd::TRUSTED[..n];
        let mut driver_times = Vec::new();
        let mut cli_times = Vec::new();
        let mut parallel_times = Vec::new();
        for i in 0..REPEATS {
            let name = format!("bench-{n}-{i}");
            let config = write_config(scratch.path(), &name, hosts, &fake_rank, &context);
            driver_times.push(driver_launch(
                &driver,
                &config,
                &sshd.config(),
                &scratch.path().join(&name),
                n,
            ));
            let label = format!("stagehand.bench={name}");
            cli_times.push(cli_launch(
                hosts,
                &sshd.config(),
                &image,
                &fake_rank,
                &label,
                false,
            ));
            parallel_times.push(cli_launch(
                hosts,
                &sshd.config(),
                &image,
                &fake_rank,
                &label,
                true,
            ));
        }
        let ms = |v: Vec<Duration>| median(v).as_secs_f64() * 1000.0;
        println!(
            "{n:>6}  {:>8.0}ms  {:>16.0}ms  {:>18.0}ms",
            ms(driver_times),
            ms(cli_times),
            ms(parallel_times)
        );
    }
}
