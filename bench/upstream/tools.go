//go:build tools

// Package tools pins the upstream whereabouts CNI plugin so that
// `go build github.com/k8snetworkplumbingwg/whereabouts/cmd` resolves
// against the version in go.mod.
package tools

import _ "github.com/k8snetworkplumbingwg/whereabouts/cmd"
