//! Making sure a host has the image: use a named one as is, or build the context through the
//! API under a tag derived from the context's hash, skipping the build when that tag exists.

use bollard::query_parameters::BuildImageOptionsBuilder;
use bollard::Docker;
use futures_util::StreamExt;

use super::context;
use crate::launch::LaunchError;
use crate::plan::ImageSource;

/// The image a host will run.
pub struct Prepared {
    /// Tag (or name) to create containers from.
    pub tag: String,
    /// Image id.
    pub id: String,
    /// Whether this run built it.
    pub built: bool,
}

/// Ensures `source` is available on the host.
pub async fn ensure(
    docker: &Docker,
    host: &str,
    source: &ImageSource,
    verbose: bool,
) -> Result<Prepared, LaunchError> {
    match source {
        ImageSource::Named(name) => match docker.inspect_image(name).await {
            Ok(i) => Ok(Prepared {
                tag: name.clone(),
                id: i.id.unwrap_or_default(),
                built: false,
            }),
            Err(_) => Err(LaunchError::ImageMissing {
                host: host.to_string(),
                image: name.clone(),
            }),
        },
        ImageSource::Build(dir) => {
            let ctx = context::pack(dir).map_err(|source| LaunchError::Context { source })?;
            let stem = dir
                .file_name()
                .map(|s| s.to_string_lossy().to_lowercase())
                .unwrap_or_default();
            let stem: String = stem
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' {
                        c
                    } else {
                        '-'
                    }
                })
                .collect();
            let tag = format!("stagehand-{stem}:{}", ctx.hash);
            if let Ok(i) = docker.inspect_image(&tag).await {
                return Ok(Prepared {
                    tag,
                    id: i.id.unwrap_or_default(),
                    built: false,
                });
            }
            let options = BuildImageOptionsBuilder::default()
                .dockerfile("Dockerfile")
                .t(&tag)
                .rm(true)
                .forcerm(true)
                .build();
            let mut stream = docker.build_image(options, None, Some(bollard::body_full(ctx.tar.into())));
            let mut tail: Vec<String> = Vec::new();
            while let Some(item) = stream.next().await {
                let info = item.map_err(|e| LaunchError::ImageBuild {
                    host: host.to_string(),
                    context: dir.clone(),
                    message: e.to_string(),
                })?;
                if let Some(detail) = info.error_detail {
                    let message = detail.message.unwrap_or_else(|| "unknown error".into());
                    return Err(LaunchError::ImageBuild {
                        host: host.to_string(),
                        context: dir.clone(),
                        message,
                    });
                }
                if let Some(text) = info.stream {
                    for line in text.lines().filter(|l| !l.trim().is_empty()) {
                        if verbose {
                            eprintln!("[{host} build] {line}");
                        }
                        tail.push(line.to_string());
                    }
                }
            }
            let id = docker
                .inspect_image(&tag)
                .await
                .map_err(|e| LaunchError::ImageBuild {
                    host: host.to_string(),
                    context: dir.clone(),
                    message: format!(
                        "the build ended but {tag} is missing ({e}); last output: {}",
                        tail.join(" | ")
                    ),
                })?
                .id
                .unwrap_or_default();
            Ok(Prepared { tag, id, built: true })
        }
    }
}
