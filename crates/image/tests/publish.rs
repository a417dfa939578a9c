//! Two image stores (two nodes) sharing one `posix:` blob store: an image published by one is
//! adopted by the other at its first lease, mounts there with the same files, and removal on
//! the adopting node leaves the shared objects while removal on the publishing node takes them.
//! Skips with a printed reason when it cannot run (root, mkfs.erofs, EROFS).

mod common;

use std::fs;

use dsec_image::{ImageError, ImageStore};

#[tokio::test]
async fn published_image_is_adopted_by_another_node_and_removed_by_its_owner() {
    skip_unless_capable!();
    let dir = tempfile::Builder::new()
        .prefix("dsec-image-publish")
        .tempdir_in("/var/tmp")
        .unwrap();
    let shared = dir.path().join("shared");
    fs::create_dir(&shared).unwrap();
    let spec = format!("posix:{}", shared.display());
    let a = ImageStore::open_with(dir.path().join("a"), &spec).unwrap();
    let b = ImageStore::open_with(dir.path().join("b"), &spec).unwrap();
    assert!(a.shares_blobs() && b.shares_blobs());
    let private = ImageStore::open(dir.path().join("p")).unwrap();
    assert!(!private.shares_blobs());

    let src = dir.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("f"), vec![5u8; 300_000]).unwrap();
    a.import_dir("snapshot/x-1", &src).await.unwrap();
    // Not published yet: the other node does not know it.
    assert!(matches!(
        b.acquire("snapshot/x-1").await,
        Err(ImageError::NotFound(_))
    ));
    a.publish("snapshot/x-1").await.unwrap();
    let objects_before: Vec<String> = names(&shared);
    assert!(
        objects_before.iter().any(|o| o.ends_with(".image")),
        "{objects_before:?}"
    );

    {
        let lease = b.acquire("snapshot/x-1").await.unwrap();
        let got = fs::read(lease.lowers()[0].join("f")).unwrap();
        assert_eq!(got, vec![5u8; 300_000]);
        let info = b.get("snapshot/x-1").unwrap();
        assert!(
            info.source.as_deref().unwrap_or("").contains("adopted"),
            "{info:?}"
        );
    }
    // The adopting node's removal keeps the shared objects.
    b.remove("snapshot/x-1").unwrap();
    assert_eq!(names(&shared), objects_before);
    // The owner's removal deletes its manifest and the layer's objects.
    a.remove("snapshot/x-1").unwrap();
    assert!(names(&shared).is_empty(), "{:?}", names(&shared));
    // Gone everywhere: no manifest to adopt any more.
    assert!(matches!(
        b.acquire("snapshot/x-1").await,
        Err(ImageError::NotFound(_))
    ));
    let _ = a.unmount_all();
    let _ = b.unmount_all();
}

fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort();
    v
}
