// Command go-webhook is the Go half of benches/webhooks.rs: the same small validating
// admission webhook served by controller-runtime's webhook.Server, so the benchmark can put
// this crate's webhook server side by side with controller-runtime's.
//
// It serves one hook, POST /validate, over HTTPS. The hook decodes the request's object as
// a ConfigMap and denies it if it carries the label "deny"; otherwise it allows it.
// There is no manager and no metrics server: only webhook.Server.Start.
//
// Flags:
//
//	-addr        host:port to listen on (port 0 = pick a free port)
//	-cert-dir    directory holding tls.crt and tls.key (PEM)
//	-ready-file  once the server accepts connections, its port is written here (decimal)
//
// scripts/go-webhook.sh builds and caches it. It runs until SIGTERM or SIGINT.
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "host:port to listen on; port 0 picks a free port")
	certDir := flag.String("cert-dir", "", "directory holding tls.crt and tls.key (PEM)")
	readyFile := flag.String("ready-file", "", "file to write the listening port to once the server accepts connections")
	flag.Parse()
	if err := run(*addr, *certDir, *readyFile); err != nil {
		fmt.Fprintln(os.Stderr, "go-webhook:", err)
		os.Exit(1)
	}
}

func run(addr, certDir, readyFile string) error {
	// No logging: the benchmark measures serving, and the Rust side does not log each request
	// either. Setting a logger also keeps controller-runtime from warning that none was set.
	ctrllog.SetLogger(logr.Discard())

	host, portText, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("bad -addr %q: %w", addr, err)
	}
	port, err := strconv.Atoi(portText)
	if err != nil {
		return fmt.Errorf("bad port in -addr %q: %w", addr, err)
	}
	// webhook.Server turns port 0 into its default (9443), so ask the kernel for a free port
	// here and hand that over. Another process could take it in between; for a benchmark on
	// one machine that risk is acceptable.
	if port == 0 {
		if port, err = freePort(host); err != nil {
			return err
		}
	}

	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		return err
	}
	decoder := admission.NewDecoder(scheme)

	server := webhook.NewServer(webhook.Options{
		Host:     host,
		Port:     port,
		CertDir:  certDir,
		CertName: "tls.crt",
		KeyName:  "tls.key",
	})
	server.Register("/validate", &webhook.Admission{Handler: admission.HandlerFunc(
		func(_ context.Context, req admission.Request) admission.Response {
			var cm corev1.ConfigMap
			if err := decoder.Decode(req, &cm); err != nil {
				return admission.Errored(http.StatusBadRequest, err)
			}
			if _, ok := cm.Labels["deny"]; ok {
				return admission.Denied("the ConfigMap has the label \"deny\"")
			}
			return admission.Allowed("")
		})})

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		// After the first signal, a second one ends the process at once.
		<-ctx.Done()
		stop()
	}()

	if readyFile != "" {
		go func() {
			if err := waitUntilServing(ctx, host, port); err != nil {
				return // shutting down before the server came up
			}
			if err := writeAtomically(readyFile, strconv.Itoa(port)); err != nil {
				fmt.Fprintln(os.Stderr, "go-webhook: writing the ready file:", err)
				os.Exit(1)
			}
		}()
	}

	return server.Start(ctx)
}

// freePort binds host:0, notes the port the kernel chose and releases it.
func freePort(host string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("picking a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitUntilServing retries a TLS handshake with the server until one succeeds. A full
// handshake (not just a TCP connect) also proves the certificate was loaded, and it keeps
// the server from logging an aborted handshake.
func waitUntilServing(ctx context.Context, host string, port int) error {
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1" // listening on every address: reach it through loopback
	}
	target := net.JoinHostPort(host, strconv.Itoa(port))
	dialer := &tls.Dialer{
		NetDialer: &net.Dialer{Timeout: time.Second},
		Config:    &tls.Config{InsecureSkipVerify: true}, // only checking that it answers
	}
	for {
		conn, err := dialer.DialContext(ctx, "tcp", target)
		if err == nil {
			return conn.Close()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// writeAtomically writes text to a temporary file next to path and renames it over path,
// so a reader never sees a partly written file.
func writeAtomically(path, text string) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	if _, err := tmp.WriteString(text); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return nil
}
