//! The install manifests in config/ stay in step with the generated CRDs in crds/.

#[test]
fn config_crd_is_a_copy_of_crds() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in [
        "ippools.yaml",
        "overlappingrangeipreservations.yaml",
        "nodeslicepools.yaml",
    ] {
        let generated = std::fs::read_to_string(root.join("crds").join(file)).unwrap();
        let copy = std::fs::read_to_string(root.join("config/crd").join(file)).unwrap();
        assert!(
            generated == copy,
            "config/crd/{file} differs from crds/{file}: run `make crds`"
        );
    }
}
