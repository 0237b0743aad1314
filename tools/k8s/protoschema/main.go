// Command protoschema writes crates/devcluster/src/protobuf/schema.rs: the protobuf
// wire schema of the kinds the simulator accepts in
// application/vnd.kubernetes.protobuf bodies, read by reflection from the
// k8s.io/api types the real control plane is built from (tools/k8s/go.mod).
// Each field carries its protobuf tag, its JSON name and what encoding/json
// does with it (omitempty, pointer, inline), so that the simulator turns a
// protobuf body into the JSON that kube-apiserver would see.
//
//	cd tools/k8s && go run ./protoschema > ../../crates/devcluster/src/protobuf/schema.rs
package main

import (
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// A kind accepted in protobuf: apiVersion, kind and its Go type.
type root struct {
	apiVersion, kind string
	t                reflect.Type
}

func of[T any]() reflect.Type { return reflect.TypeFor[T]() }

var roots = []root{
	{"v1", "Pod", of[corev1.Pod]()},
	{"v1", "Namespace", of[corev1.Namespace]()},
	{"v1", "Node", of[corev1.Node]()},
	{"v1", "Service", of[corev1.Service]()},
	{"v1", "Secret", of[corev1.Secret]()},
	{"v1", "ConfigMap", of[corev1.ConfigMap]()},
	{"v1", "ServiceAccount", of[corev1.ServiceAccount]()},
	{"v1", "Event", of[corev1.Event]()},
	{"apps/v1", "Deployment", of[appsv1.Deployment]()},
	{"apps/v1", "ReplicaSet", of[appsv1.ReplicaSet]()},
	{"discovery.k8s.io/v1", "EndpointSlice", of[discoveryv1.EndpointSlice]()},
	{"coordination.k8s.io/v1", "Lease", of[coordinationv1.Lease]()},
	{"rbac.authorization.k8s.io/v1", "Role", of[rbacv1.Role]()},
	{"rbac.authorization.k8s.io/v1", "RoleBinding", of[rbacv1.RoleBinding]()},
	{"rbac.authorization.k8s.io/v1", "ClusterRole", of[rbacv1.ClusterRole]()},
	{"rbac.authorization.k8s.io/v1", "ClusterRoleBinding", of[rbacv1.ClusterRoleBinding]()},
	{"networking.k8s.io/v1", "NetworkPolicy", of[networkingv1.NetworkPolicy]()},
	{"policy/v1", "PodDisruptionBudget", of[policyv1.PodDisruptionBudget]()},
	{"authentication.k8s.io/v1", "TokenReview", of[authenticationv1.TokenReview]()},
	{"authentication.k8s.io/v1", "TokenRequest", of[authenticationv1.TokenRequest]()},
	{"authentication.k8s.io/v1", "SelfSubjectReview", of[authenticationv1.SelfSubjectReview]()},
	{"authorization.k8s.io/v1", "SelfSubjectAccessReview", of[authorizationv1.SelfSubjectAccessReview]()},
	{"authorization.k8s.io/v1", "SelfSubjectRulesReview", of[authorizationv1.SelfSubjectRulesReview]()},
	{"authorization.k8s.io/v1", "SubjectAccessReview", of[authorizationv1.SubjectAccessReview]()},
	{"authorization.k8s.io/v1", "LocalSubjectAccessReview", of[authorizationv1.LocalSubjectAccessReview]()},
	{"autoscaling/v1", "Scale", of[autoscalingv1.Scale]()},
	{"v1", "DeleteOptions", of[metav1.DeleteOptions]()},
	{"meta.k8s.io/v1", "DeleteOptions", of[metav1.DeleteOptions]()},
}

// Types with their own wire and JSON forms.
var special = map[reflect.Type]string{
	of[metav1.Time]():          "Time",
	of[metav1.MicroTime]():     "MicroTime",
	of[metav1.Duration]():      "Duration",
	of[resource.Quantity]():    "Quantity",
	of[intstr.IntOrString]():   "IntOrString",
	of[runtime.RawExtension](): "Raw",
	of[metav1.FieldsV1]():      "Raw",
}

type field struct {
	tag                         int
	json                        string
	ty                          string
	repeated, ptr, omit, inline bool
}

var (
	index    = map[reflect.Type]int{}
	messages []reflect.Type
	bodies   [][]field
)

func message(t reflect.Type) int {
	if i, ok := index[t]; ok {
		return i
	}
	i := len(messages)
	index[t] = i
	messages = append(messages, t)
	bodies = append(bodies, nil)
	bodies[i] = fields(t)
	return i
}

func fail(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "protoschema: "+format+"\n", a...)
	os.Exit(1)
}

// The schema type of a value of Go type t, encoded with wire type wire.
func typeOf(t reflect.Type, wire string, where string) string {
	if s, ok := special[t]; ok {
		return s
	}
	switch t.Kind() {
	case reflect.String:
		return "Str"
	case reflect.Bool:
		return "Bool"
	case reflect.Int32:
		return "I32"
	case reflect.Int64:
		return "I64"
	case reflect.Int:
		return "I64"
	case reflect.Uint32:
		return "U32"
	case reflect.Uint64:
		return "U64"
	case reflect.Float64:
		if wire != "fixed64" {
			fail("%s: float64 on wire %s", where, wire)
		}
		return "F64"
	case reflect.Struct:
		return fmt.Sprintf("Msg(%d)", message(t))
	case reflect.Slice:
		if t.Elem().Kind() == reflect.Uint8 {
			return "Bytes"
		}
		if t.Name() != "" && t.Elem().Kind() == reflect.String {
			// A named []string (ExtraValue, Verbs) is a message of `items`.
			return "StringList"
		}
	}
	fail("%s: unsupported Go type %s (wire %s)", where, t, wire)
	return ""
}

func fields(t reflect.Type) []field {
	var out []field
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		pb, ok := f.Tag.Lookup("protobuf")
		if !ok || pb == "-" {
			continue
		}
		parts := strings.Split(pb, ",")
		tag, err := strconv.Atoi(parts[1])
		if err != nil {
			fail("%s.%s: protobuf tag %q", t, f.Name, pb)
		}
		jsonTag := f.Tag.Get("json")
		jparts := strings.Split(jsonTag, ",")
		name := jparts[0]
		if name == "-" {
			continue
		}
		fd := field{tag: tag, json: name}
		for _, p := range jparts[1:] {
			switch p {
			case "omitempty":
				fd.omit = true
			case "inline":
				fd.inline = true
			}
		}
		// encoding/json flattens an embedded struct without a JSON name.
		if name == "" && f.Anonymous {
			fd.inline = true
		}
		if name == "" && !fd.inline {
			fd.json = f.Name
		}
		ft := f.Type
		where := t.String() + "." + f.Name
		if ft.Kind() == reflect.Pointer {
			fd.ptr = true
			ft = ft.Elem()
		}
		wire := parts[0]
		switch {
		case ft.Kind() == reflect.Map:
			kw := strings.Split(f.Tag.Get("protobuf_key"), ",")[0]
			vw := strings.Split(f.Tag.Get("protobuf_val"), ",")[0]
			fd.ty = fmt.Sprintf("Map(&%s, &%s)", typeOf(ft.Key(), kw, where+"[key]"), typeOf(ft.Elem(), vw, where+"[value]"))
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() != reflect.Uint8 && !(ft.Name() != "" && ft.Elem().Kind() == reflect.String):
			fd.repeated = true
			et := ft.Elem()
			if et.Kind() == reflect.Pointer {
				et = et.Elem()
			}
			fd.ty = typeOf(et, wire, where+"[]")
		default:
			fd.ty = typeOf(ft, wire, where)
		}
		out = append(out, fd)
	}
	return out
}

func main() {
	type kind struct {
		apiVersion, kind string
		msg              int
	}
	var kinds []kind
	for _, r := range roots {
		kinds = append(kinds, kind{r.apiVersion, r.kind, message(r.t)})
	}
	w := os.Stdout
	fmt.Fprintln(w, "// @generated by tools/k8s/protoschema from the k8s.io/api and k8s.io/apimachinery")
	fmt.Fprintln(w, "// versions of tools/k8s/go.mod. Do not edit: run")
	fmt.Fprintln(w, "// `cd tools/k8s && go run ./protoschema > ../../crates/devcluster/src/protobuf/schema.rs`.")
	fmt.Fprintln(w, "")
	fmt.Fprintln(w, "use super::{Field, Message, Ty::*};")
	fmt.Fprintln(w, "")
	fmt.Fprintln(w, "/// The kinds accepted in protobuf bodies: apiVersion, kind, message.")
	fmt.Fprintln(w, "pub static KINDS: &[(&str, &str, u16)] = &[")
	for _, k := range kinds {
		fmt.Fprintf(w, "    (%q, %q, %d),\n", k.apiVersion, k.kind, k.msg)
	}
	fmt.Fprintln(w, "];")
	fmt.Fprintln(w, "")
	fmt.Fprintln(w, "/// Every message reachable from `KINDS`, by index.")
	fmt.Fprintln(w, "pub static MESSAGES: &[Message] = &[")
	for i, t := range messages {
		fmt.Fprintf(w, "    // %d\n", i)
		fmt.Fprintf(w, "    Message {\n        name: %q,\n        fields: &[\n", t.PkgPath()+"."+t.Name())
		for _, f := range bodies[i] {
			fmt.Fprintf(w, "            Field { tag: %d, json: %q, ty: %s, repeated: %t, ptr: %t, omitempty: %t, inline: %t },\n",
				f.tag, f.json, f.ty, f.repeated, f.ptr, f.omit, f.inline)
		}
		fmt.Fprintln(w, "        ],\n    },")
	}
	fmt.Fprintln(w, "];")
}
