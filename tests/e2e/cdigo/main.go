// Command cdigo answers, with the CDI project's own Go library (Debian's
// golang-github-container-orchestrated-devices-container-device-interface-dev,
// built in GOPATH mode), what tests/e2e/test_cdi_go.py asks about hostpid's
// CDI output: what the library's annotation helpers make of a plugin name,
// device ID and device list; and, as a runtime does for a kubelet older than
// 1.29, which devices a pod's annotations name and what injecting them from
// a spec directory does to an empty OCI spec.
//
// Input (stdin, JSON): {"keys": [{"plugin", "deviceID", "devices"}],
// "annotations": {...}, "specDir": "..."}.  Output (stdout, JSON): one
// answer per key, then the parsed annotations and the injected edits.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/container-orchestrated-devices/container-device-interface/pkg/cdi"
	oci "github.com/opencontainers/runtime-spec/specs-go"
)

type keyCase struct {
	Plugin   string   `json:"plugin"`
	DeviceID string   `json:"deviceID"`
	Devices  []string `json:"devices"`
}

type request struct {
	Keys        []keyCase         `json:"keys"`
	Annotations map[string]string `json:"annotations"`
	SpecDir     string            `json:"specDir"`
}

type keyAnswer struct {
	Annotations map[string]string `json:"annotations"`
	Error       string            `json:"error"`
}

type injected struct {
	Keys     []string    `json:"keys"`
	Devices  []string    `json:"devices"`
	Error    string      `json:"error"`
	Env      []string    `json:"env"`
	Mounts   []oci.Mount `json:"mounts"`
	Unknown  []string    `json:"unknown"`
	SpecErrs []string    `json:"specErrors"`
}

type answer struct {
	Keys     []keyAnswer `json:"keys"`
	Injected injected    `json:"injected"`
}

func errorText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func main() {
	var req request
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		fmt.Fprintln(os.Stderr, "cdigo: bad request:", err)
		os.Exit(2)
	}
	var out answer
	for _, k := range req.Keys {
		annotations, err := cdi.UpdateAnnotations(nil, k.Plugin, k.DeviceID, k.Devices)
		out.Keys = append(out.Keys, keyAnswer{annotations, errorText(err)})
	}
	keys, devices, err := cdi.ParseAnnotations(req.Annotations)
	out.Injected = injected{Keys: keys, Devices: devices, Error: errorText(err)}
	if err == nil && req.SpecDir != "" {
		cache, err := cdi.NewCache(cdi.WithSpecDirs(req.SpecDir), cdi.WithAutoRefresh(false))
		if err != nil {
			out.Injected.Error = errorText(err)
		} else {
			for path, errs := range cache.GetErrors() {
				for _, e := range errs {
					out.Injected.SpecErrs = append(out.Injected.SpecErrs, path+": "+e.Error())
				}
			}
			spec := &oci.Spec{Process: &oci.Process{}}
			unknown, err := cache.InjectDevices(spec, devices...)
			out.Injected.Unknown = unknown
			out.Injected.Error = errorText(err)
			out.Injected.Env = spec.Process.Env
			out.Injected.Mounts = spec.Mounts
		}
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "cdigo:", err)
		os.Exit(2)
	}
}
