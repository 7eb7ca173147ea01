//! Making sure every host has the image, without a registry. A named image is used as is. A build
//! is tagged by its context's hash (with its Dockerfile and arguments); each host that already has
//! that tag keeps it; otherwise the image is built on one host per CPU architecture (the first in
//! the experiment's order, or none when one of them has it) and streamed from there to the hosts
//! that lack it, all at once, through the Docker API (`GET /images/{name}/get` on one,
//! `POST /images/load` on the others). A changed source gives a new tag, so the next run rebuilds
//! once and sends the result everywhere.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use bollard::query_parameters::{BuildImageOptionsBuilder, ImportImageOptionsBuilder};
use bollard::Docker;
use bytes::Bytes;
use futures_util::future::join_all;
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::context;
use super::HostError;
use crate::experiment::{BuildSpec, ImageSource};

/// What preflight learned about a host's image.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// Tag (or name) to create containers from.
    pub tag: String,
    /// Image id.
    pub id: String,
    /// Whether this run built it on this host.
    pub built: bool,
    /// The host it was streamed from in this run, if it was.
    pub received_from: Option<String>,
    /// Seconds this host spent getting the image (building or receiving it); 0 when it had it.
    pub seconds: f64,
}

/// How much to tell the user while images are built and sent.
#[derive(Debug, Clone, Copy)]
pub struct Feedback {
    /// Echo the build's output.
    pub verbose: bool,
    /// Say when a build or a transfer starts and ends.
    pub normal: bool,
    /// Draw transfer progress bars (on a terminal).
    pub bars: bool,
}

/// One host's engine, by the name the experiment gives it.
pub struct Engine<'a> {
    /// Host name.
    pub host: &'a str,
    /// Its engine.
    pub docker: &'a Docker,
    /// Its CPU architecture, as the engine reports it.
    pub arch: &'a str,
}

/// Makes sure every engine has the image; returns what each got, in the same order. Nothing is
/// built or sent before `before_changes` resolves.
pub async fn ensure_all(
    engines: &[Engine<'_>],
    source: &ImageSource,
    feedback: Feedback,
    before_changes: impl std::future::Future<Output = ()>,
) -> Result<Vec<Prepared>, HostError> {
    match source {
        ImageSource::Named(name) => {
            let found = inspect_all(engines, name).await;
            named(engines, name, found, feedback, before_changes).await
        }
        ImageSource::Build(spec) => ensure_built(engines, spec, feedback, before_changes).await,
        ImageSource::Base { name, build } => {
            let found = inspect_all(engines, name).await;
            if found.iter().flatten().any(holds_runtime) {
                named(engines, name, found, feedback, before_changes).await
            } else {
                ensure_built(engines, build, feedback, before_changes).await
            }
        }
    }
}

/// The label the runtime image carries (docker/runtime/Dockerfile).
const RUNTIME_TITLE: &str = "stagehand runtime";

/// Whether an image already holds the stagehand runtime: the runtime image's own, or one built
/// on it.
fn holds_runtime(image: &bollard::models::ImageInspect) -> bool {
    image
        .config
        .as_ref()
        .and_then(|c| c.labels.as_ref())
        .and_then(|l| l.get("org.opencontainers.image.title"))
        .is_some_and(|t| t == RUNTIME_TITLE)
}

/// What every engine says of the image `name`, in the engines' order.
async fn inspect_all(
    engines: &[Engine<'_>],
    name: &str,
) -> Vec<Result<bollard::models::ImageInspect, bollard::errors::Error>> {
    join_all(engines.iter().map(|e| e.docker.inspect_image(name))).await
}

/// An image used as named (`found`: what each engine said of it): an engine that lacks it is
/// sent it from one of its architecture that has it, as a built image is; with none, it is
/// missing there.
async fn named(
    engines: &[Engine<'_>],
    name: &str,
    found: Vec<Result<bollard::models::ImageInspect, bollard::errors::Error>>,
    feedback: Feedback,
    before_changes: impl std::future::Future<Output = ()>,
) -> Result<Vec<Prepared>, HostError> {
    let mut out: Vec<Option<Prepared>> = found
        .into_iter()
        .map(|found| found.ok().map(|i| Prepared::held(name, i.id.unwrap_or_default())))
        .collect();
    if out.iter().all(Option::is_some) {
        return Ok(every_host(out));
    }
    let groups = by_arch(engines);
    if let Some(members) = groups.values().find(|m| m.iter().all(|&i| out[i].is_none())) {
        return Err(HostError::ImageMissing {
            host: engines[members[0]].host.to_string(),
            image: name.to_string(),
        });
    }
    before_changes.await;
    let sends = groups.into_values().map(|members| {
        let out = &out;
        async move {
            let source = *members
                .iter()
                .find(|&&i| out[i].is_some())
                .expect("checked above");
            send_within(engines, &members, source, out, name, feedback).await
        }
    });
    for got in join_all(sends).await {
        for (i, prepared) in got? {
            out[i] = Some(prepared);
        }
    }
    Ok(every_host(out))
}

impl Prepared {
    /// An image a host already had.
    fn held(tag: &str, id: String) -> Prepared {
        Prepared {
            tag: tag.to_string(),
            id,
            built: false,
            received_from: None,
            seconds: 0.0,
        }
    }
}

/// The engines' indices by CPU architecture (images are built and sent once per architecture).
fn by_arch<'a>(engines: &[Engine<'a>]) -> BTreeMap<&'a str, Vec<usize>> {
    let mut by_arch: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, e) in engines.iter().enumerate() {
        by_arch.entry(e.arch).or_default().push(i);
    }
    by_arch
}

/// Streams `tag` from engine `source` to every engine of `members` that lacks it (`out` says
/// which have it), all at once; returns what each receiver got.
async fn send_within(
    engines: &[Engine<'_>],
    members: &[usize],
    source: usize,
    out: &[Option<Prepared>],
    tag: &str,
    feedback: Feedback,
) -> Result<Vec<(usize, Prepared)>, HostError> {
    let targets: Vec<usize> = members
        .iter()
        .copied()
        .filter(|&i| i != source && out[i].is_none())
        .collect();
    if targets.is_empty() {
        return Ok(Vec::new());
    }
    let to: Vec<&Engine> = targets.iter().map(|&i| &engines[i]).collect();
    let sent = distribute(&engines[source], &to, tag, feedback).await?;
    Ok(targets
        .into_iter()
        .zip(sent)
        .map(|(i, (id, seconds))| {
            let received = Prepared {
                received_from: Some(engines[source].host.to_string()),
                seconds,
                ..Prepared::held(tag, id)
            };
            (i, received)
        })
        .collect())
}

/// What every host has, once each has it.
fn every_host(out: Vec<Option<Prepared>>) -> Vec<Prepared> {
    out.into_iter()
        .map(|p| p.expect("every host has the image"))
        .collect()
}

/// The tag a build gets: its repository and the first 16 hex digits of its context's hash.
pub fn tag_of(spec: &BuildSpec, context: &context::Context) -> String {
    format!("{}:{}", spec.repository, &context.hash[..16])
}

/// The tag `spec` builds, from its context as it is now on this machine (no engine asked).
pub fn planned_tag(spec: &BuildSpec) -> Result<String, HostError> {
    let listing = context::list(&spec.context, &spec.dockerfile, &extra(spec))?;
    Ok(tag_of(spec, &listing))
}

/// What the hash covers beside the files: the Dockerfile's name and the build arguments.
fn extra(spec: &BuildSpec) -> String {
    let mut s = format!("dockerfile={}\n", spec.dockerfile);
    for (k, v) in &spec.args {
        s.push_str(&format!("arg {k}={v}\n"));
    }
    s
}

async fn ensure_built(
    engines: &[Engine<'_>],
    spec: &BuildSpec,
    feedback: Feedback,
    before_changes: impl std::future::Future<Output = ()>,
) -> Result<Vec<Prepared>, HostError> {
    let listing = {
        let spec = spec.clone();
        tokio::task::spawn_blocking(move || context::list(&spec.context, &spec.dockerfile, &extra(&spec)))
            .await
            .expect("listing the context does not panic")?
    };
    let tag = tag_of(spec, &listing);

    // What each host has.
    let looks = join_all(
        engines
            .iter()
            .map(|e| async { e.docker.inspect_image(&tag).await.ok().and_then(|i| i.id) }),
    )
    .await;

    let mut out: Vec<Option<Prepared>> = looks
        .into_iter()
        .map(|have| have.map(|id| Prepared::held(&tag, id)))
        .collect();

    if out.iter().any(Option::is_none) {
        before_changes.await;
    }

    // One build (at most) and one fan-out per architecture, the architectures side by side.
    let groups = by_arch(engines).into_values().map(|members| {
        let out = &out;
        let listing = &listing;
        let tag = &tag;
        async move {
            let mut got: Vec<(usize, Prepared)> = Vec::new();
            let source = match members.iter().find(|&&i| out[i].is_some()) {
                Some(&i) => i,
                None => {
                    let i = members[0];
                    let e = &engines[i];
                    let started = Instant::now();
                    if feedback.normal {
                        stderr_line!(
                            "driver: building {tag} on {} ({} files, {} of source; once per source version)",
                            e.host,
                            listing.file_count(),
                            human_bytes(listing.bytes)
                        );
                    }
                    send_bases(e, spec, feedback).await?;
                    let id = build(e, spec, listing, tag, feedback).await?;
                    let seconds = started.elapsed().as_secs_f64();
                    if feedback.normal {
                        stderr_line!("driver: built {tag} on {} in {seconds:.0} s", e.host);
                    }
                    let built = Prepared {
                        built: true,
                        seconds,
                        ..Prepared::held(tag, id)
                    };
                    got.push((i, built));
                    i
                }
            };
            got.extend(send_within(engines, &members, source, out, tag, feedback).await?);
            Ok::<_, HostError>(got)
        }
    });
    for group in join_all(groups).await {
        for (i, prepared) in group? {
            out[i] = Some(prepared);
        }
    }
    Ok(every_host(out))
}

/// Builds the image on one engine from the streamed context; returns its id.
async fn build(
    engine: &Engine<'_>,
    spec: &BuildSpec,
    listing: &context::Context,
    tag: &str,
    feedback: Feedback,
) -> Result<String, HostError> {
    let failed = |message: String| HostError::ImageBuild {
        host: engine.host.to_string(),
        context: spec.context.clone(),
        message,
    };
    let args: HashMap<String, String> = spec.args.clone().into_iter().collect();
    let options = BuildImageOptionsBuilder::default()
        .dockerfile(&spec.dockerfile)
        .t(tag)
        .buildargs(&args)
        .rm(true)
        .forcerm(true)
        .build();
    let body = bollard::body_try_stream(context::stream(listing));
    let mut stream = engine.docker.build_image(options, None, Some(body));
    let started = Instant::now();
    let mut tail: Vec<String> = Vec::new();
    // A base image the engine lacks, and could not pull (no registry here), is named.
    let failure = |message: String, tail: &[String]| {
        let last = last_lines(tail);
        async move {
            let missing = missing_bases(engine, spec).await;
            if missing.is_empty() {
                return failed(format!("{message}{last}"));
            }
            HostError::BaseImagesMissing {
                host: engine.host.to_string(),
                images: missing,
                reason: message.lines().next().unwrap_or_default().to_string(),
            }
        }
    };
    while let Some(item) = stream.next().await {
        let info = match item {
            Ok(info) => info,
            Err(e) => return Err(failure(e.to_string(), &tail).await),
        };
        if let Some(detail) = info.error_detail {
            let message = detail.message.unwrap_or_else(|| "unknown error".into());
            return Err(failure(message, &tail).await);
        }
        if let Some(text) = info.stream {
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                if feedback.verbose {
                    stderr_line!("[{} build] {line}", engine.host);
                } else if let (true, Some(step)) = (feedback.normal, step_started(line)) {
                    // A build takes minutes: each step is said as it starts, with the time so far.
                    stderr_line!("[{} build {}] {step}", engine.host, clock(started.elapsed()));
                }
                tail.push(line.to_string());
                if tail.len() > 20 {
                    tail.remove(0);
                }
            }
        }
    }
    let image = engine.docker.inspect_image(tag).await.map_err(|e| {
        failed(format!(
            "the build ended but {tag} is missing ({e}){}",
            last_lines(&tail)
        ))
    })?;
    Ok(image.id.unwrap_or_default())
}

/// Widest a build step is said (`-v` shows the whole line).
const STEP_WIDTH: usize = 100;

/// The step a build's output `line` says it starts (`Step 3/9 : RUN ...`), cut to
/// [`STEP_WIDTH`] characters; `None` for any other line.
fn step_started(line: &str) -> Option<String> {
    let line = line.trim();
    let (count, _) = line.strip_prefix("Step ")?.split_once(" : ")?;
    let (n, of) = count.split_once('/')?;
    if !(n.parse::<u32>().is_ok() && of.parse::<u32>().is_ok()) {
        return None;
    }
    Some(match line.char_indices().nth(STEP_WIDTH) {
        Some((cut, _)) => format!("{}...", &line[..cut]),
        None => line.to_string(),
    })
}

/// `elapsed` as minutes and seconds: `0:07`, `4:31`.
fn clock(elapsed: std::time::Duration) -> String {
    let s = elapsed.as_secs();
    format!("{}:{:02}", s / 60, s % 60)
}

/// What this machine's engine is called where it sends images.
const THIS_MACHINE: &str = "this machine";

/// Sends the base images `spec`'s build needs from this machine's engine (`DOCKER_HOST`, or the
/// local socket) to `engine` where it lacks them and this machine holds them, for the same CPU
/// architecture: a first build on a fresh host then needs nothing put there by hand, with no
/// registry to pull from. What neither holds is left to the build, which names it.
async fn send_bases(engine: &Engine<'_>, spec: &BuildSpec, feedback: Feedback) -> Result<(), HostError> {
    let missing = missing_bases(engine, spec).await;
    if missing.is_empty() {
        return Ok(());
    }
    let Ok(local) = Docker::connect_with_local_defaults() else {
        return Ok(());
    };
    let arch = tokio::time::timeout(std::time::Duration::from_secs(10), local.version()).await;
    if !matches!(&arch, Ok(Ok(v)) if v.arch.as_deref() == Some(engine.arch)) {
        return Ok(());
    }
    let here = Engine {
        host: THIS_MACHINE,
        docker: &local,
        arch: engine.arch,
    };
    for image in missing {
        // The same engine under two names lacks them too: nothing is sent.
        if local.inspect_image(&image).await.is_ok() {
            distribute(&here, &[engine], &image, feedback).await?;
        }
    }
    Ok(())
}

/// The base images `spec`'s Dockerfile builds from that `engine` lacks.
async fn missing_bases(engine: &Engine<'_>, spec: &BuildSpec) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(spec.context.join(&spec.dockerfile)) else {
        return Vec::new();
    };
    let mut missing = Vec::new();
    for image in base_images(&text, &spec.args) {
        if engine.docker.inspect_image(&image).await.is_err() {
            missing.push(image);
        }
    }
    missing
}

/// The images a Dockerfile's `FROM` lines name, `${ARG}`s replaced by the build's arguments or
/// the Dockerfile's defaults; not `scratch`, nor an earlier stage (`FROM x AS builder`).
fn base_images(dockerfile: &str, args: &BTreeMap<String, String>) -> Vec<String> {
    let mut defaults: HashMap<String, String> = HashMap::new();
    let mut stages: Vec<String> = Vec::new();
    let mut images = Vec::new();
    for line in dockerfile.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        let instruction = words.next().unwrap_or_default().to_ascii_uppercase();
        match instruction.as_str() {
            "ARG" => {
                if let Some((name, value)) = words.next().and_then(|a| a.split_once('=')) {
                    defaults.insert(name.to_string(), value.trim_matches('"').to_string());
                }
            }
            "FROM" => {
                let mut words = words.skip_while(|w| w.starts_with("--"));
                let Some(image) = words.next() else { continue };
                let mut image = image.to_string();
                let given = |name: &String| args.contains_key(name);
                let values = args
                    .iter()
                    .chain(defaults.iter().filter(|(name, _)| !given(name)));
                for (name, value) in values {
                    image = image
                        .replace(&format!("${{{name}}}"), value)
                        .replace(&format!("${name}"), value);
                }
                let is_stage = stages.iter().any(|s| s.eq_ignore_ascii_case(&image));
                if !is_stage && image != "scratch" && !image.contains('$') && !images.contains(&image) {
                    images.push(image);
                }
                if words.next().is_some_and(|w| w.eq_ignore_ascii_case("as")) {
                    stages.extend(words.next().map(str::to_string));
                }
            }
            _ => {}
        }
    }
    images
}

fn last_lines(tail: &[String]) -> String {
    match tail.len() {
        0 => String::new(),
        n => format!("; its last output: {}", tail[n.saturating_sub(8)..].join(" | ")),
    }
}

/// Chunks in flight towards each receiving host.
const IN_FLIGHT: usize = 16;

/// Streams `tag` from `from` to every engine of `to` at once: one export, read once, its chunks
/// handed to each receiver (the slowest sets the pace). Returns each receiver's image id and the
/// seconds it took.
async fn distribute(
    from: &Engine<'_>,
    to: &[&Engine<'_>],
    tag: &str,
    feedback: Feedback,
) -> Result<Vec<(String, f64)>, HostError> {
    let started = Instant::now();
    let size = from
        .docker
        .inspect_image(tag)
        .await
        .ok()
        .and_then(|i| i.size)
        .unwrap_or(0)
        .max(0) as u64;
    if feedback.normal {
        let names: Vec<&str> = to.iter().map(|e| e.host).collect();
        stderr_line!(
            "driver: sending {tag} ({}) from {} to {}",
            human_bytes(size),
            from.host,
            names.join(", ")
        );
    }
    let transfer_err = |host: &str, message: String| HostError::ImageTransfer {
        from: from.host.to_string(),
        to: host.to_string(),
        image: tag.to_string(),
        message,
    };
    let style = ProgressStyle::with_template("{prefix:>12} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
        .expect("a valid template")
        .progress_chars("=> ");
    let mut senders = Vec::new();
    let mut loads = Vec::new();
    for e in to {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(IN_FLIGHT);
        let bar = if feedback.bars {
            ProgressBar::with_draw_target(Some(size), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(style.clone());
        bar.set_prefix(e.host.to_string());
        senders.push((tx, bar.clone()));
        let body = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
        let docker = e.docker;
        let host = e.host;
        loads.push(async move {
            let options = ImportImageOptionsBuilder::default().quiet(true).build();
            let mut replies = docker.import_image_stream(options, body, None);
            while let Some(reply) = replies.next().await {
                let reply = reply.map_err(|err| transfer_err(host, err.to_string()))?;
                if let Some(detail) = reply.error_detail {
                    return Err(transfer_err(host, detail.message.unwrap_or_default()));
                }
            }
            let id = docker
                .inspect_image(tag)
                .await
                .map_err(|err| {
                    transfer_err(host, format!("the load ended but the image is missing ({err})"))
                })?
                .id
                .unwrap_or_default();
            bar.finish_and_clear();
            Ok::<_, HostError>((id, started.elapsed().as_secs_f64()))
        });
    }
    let pump = async {
        let mut export = from.docker.export_image(tag);
        while let Some(chunk) = export.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(err) => {
                    let reason = format!("reading the image from {} failed: {err}", from.host);
                    for (tx, _) in &senders {
                        let _ = tx.send(Err(std::io::Error::other(reason.clone()))).await;
                    }
                    return;
                }
            };
            // A receiver that failed has dropped its end; the others go on.
            for (tx, bar) in &senders {
                if tx.send(Ok(chunk.clone())).await.is_ok() {
                    bar.inc(chunk.len() as u64);
                }
            }
        }
        drop(senders);
    };
    let (_, results) = tokio::join!(pump, join_all(loads));
    let results = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    if feedback.normal {
        stderr_line!(
            "driver: {tag} is on {} more host(s) after {:.1} s",
            results.len(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(results)
}

/// `n` bytes for people.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The base images a build needs are read from its Dockerfile as Docker reads them: ARG
    /// defaults, overridden by the build's arguments, neither stages nor `scratch`.
    #[test]
    fn a_dockerfiles_base_images_are_its_from_lines_with_their_args() {
        let runtime = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docker/runtime/Dockerfile"),
        )
        .unwrap();
        assert_eq!(
            base_images(&runtime, &BTreeMap::new()),
            [
                "stagehand-torch:2.11.0-cpu",
                "stagehand-build:bookworm",
                "stagehand-base:bookworm"
            ]
        );
        let args = BTreeMap::from([(
            "TORCH_IMAGE".to_string(),
            "stagehand-torch:2.11.0-cu128".to_string(),
        )]);
        assert_eq!(base_images(&runtime, &args)[0], "stagehand-torch:2.11.0-cu128");
        let staged = "FROM --platform=linux/amd64 debian:12 AS build\nRUN true\nfrom build\nFROM scratch\n";
        assert_eq!(base_images(staged, &BTreeMap::new()), ["debian:12"]);
    }

    #[test]
    fn an_image_holds_the_runtime_when_its_label_says_so() {
        let labelled = |title: Option<&str>| bollard::models::ImageInspect {
            config: Some(bollard::models::ImageConfig {
                labels: title
                    .map(|t| HashMap::from([("org.opencontainers.image.title".to_string(), t.to_string())])),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(holds_runtime(&labelled(Some("stagehand runtime"))));
        assert!(!holds_runtime(&labelled(Some("PyTorch"))));
        assert!(!holds_runtime(&labelled(None)));
        assert!(!holds_runtime(&bollard::models::ImageInspect::default()));
        // The runtime's Dockerfile sets the label this looks for.
        let dockerfile = include_str!("../../../docker/runtime/Dockerfile");
        assert!(dockerfile.contains(&format!(
            "LABEL org.opencontainers.image.title=\"{RUNTIME_TITLE}\""
        )));
    }

    #[test]
    fn a_build_step_is_said_as_it_starts_cut_to_a_line() {
        assert_eq!(
            step_started("Step 2/9 : ARG GREETING").as_deref(),
            Some("Step 2/9 : ARG GREETING")
        );
        let long = format!("Step 5/9 : RUN {}", "x".repeat(200));
        let said = step_started(&long).unwrap();
        assert_eq!(said.chars().count(), STEP_WIDTH + 3);
        assert!(said.starts_with("Step 5/9 : RUN xx") && said.ends_with("x..."));
        for other in [
            " ---> Running in 3f1c",
            "Stepping : in",
            "Step x/9 : RUN",
            "Successfully built",
        ] {
            assert_eq!(step_started(other), None, "{other}");
        }
        assert_eq!(clock(std::time::Duration::from_secs(7)), "0:07");
        assert_eq!(clock(std::time::Duration::from_secs(271)), "4:31");
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
    }

    #[test]
    fn the_tag_changes_with_the_build_arguments() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("Dockerfile"), "FROM scratch\n").unwrap();
        let mut spec = BuildSpec {
            context: dir.path().to_path_buf(),
            dockerfile: "Dockerfile".into(),
            args: BTreeMap::new(),
            repository: "stagehand-x".into(),
        };
        let a = tag_of(
            &spec,
            &context::list(dir.path(), "Dockerfile", &extra(&spec)).unwrap(),
        );
        spec.args.insert("TORCH_IMAGE".into(), "t:cuda".into());
        let b = tag_of(
            &spec,
            &context::list(dir.path(), "Dockerfile", &extra(&spec)).unwrap(),
        );
        assert!(a.starts_with("stagehand-x:") && a.len() == "stagehand-x:".len() + 16);
        assert_ne!(a, b);
    }
}
